#pragma once
// ForwardOutputs: what this iteration's forward() calls returned, watched so that the next forward()
// can tell whether a backward may still come through their graphs (Note [Several forwards]).
//
// Contract: note() and clear() on the thread that runs forward(); graph_awaits_backward() on it too.
// The flag a backward sets runs on autograd's threads (an atomic). Tensors are looked for alone, in a
// std::vector, a pair or a tuple (nested); anything else forward() returns is not looked into.
//
// Note [Several forwards]
// A contrastive loss over two views, a distillation term from a second pass, a loss summed over two
// batches: several forward() calls, then one backward() through all their graphs, as with an unwrapped
// module. A forward() used to end the previous one's iteration as an evaluation: the warm-up's repack
// then moved every parameter, and the backward through the first graph met a saved parameter with no
// storage (a raw "setStorage ... out of bounds" error); later the scheduler traced each forward as an
// iteration of its own. Now a forward() after a training forward (under grad mode) continues the
// iteration while some graph of it can still reach a parameter: the backward that may follow needs the
// parameters as the forwards saw them. The test is the parameters' gradient accumulators: autograd keeps
// only a weak reference to them in the parameter, the graph holds them, so an accumulator is alive
// exactly while a graph that can push a gradient into its parameter is (ferry holds none: its gradient
// hooks live in the parameter's autograd meta). A validation loop that forgot NoGradGuard drops each
// output before the next forward(): no accumulator is left, and each forward ends the last one's
// iteration as before (one probe per parameter, only when a forward follows a training forward). The
// continued iteration is one to the scheduler: one trace position sequence (the warm-up records both
// forwards and the backward), one forward time from the first forward's start to the last one's end,
// and ops between the forwards are uses as between forward and backward (D58). A ferry::checkpoint
// segment holds its parameters' accumulators too (Note [Checkpoint parameters as inputs]). A graph that
// reaches parameters only through frozen ones holds none (a frozen feature network as a perceptual
// loss, run on the output and on the target): a later forward() ended its iteration, and in the
// warm-up a frozen weight's saved view met the repack ("setStorage ... out of bounds"). So the node of
// each tensor forward() returns (alone or in a vector, pair or tuple) is watched too: while it is alive
// and no backward has run through it (a pre-hook on it says so), a graph that saved views of the
// chunks may still be backwarded. The pre-hook is what keeps a loss the user holds past the next
// forward (a logging loop) from holding the iteration open for good once its backward ran, when that
// backward was not this model's (the user's own `loss.backward()` through a model without a gradient
// sink, or another model's backward()). Only a backward that frees the graph counts: one that keeps
// it (a gradient penalty's autograd::grad with create_graph, then more forwards before the backward,
// as a WGAN-GP critic does) leaves it to be backwarded again. Once a backward ran through one of them
// the accumulators are not asked: a held loss keeps its graph's accumulators alive too, and a trainable model without a
// sink backwarded by `loss.backward()` would otherwise never end an iteration either. A forward that
// returns something else (a struct) is seen only through its accumulators, and only while no returned
// node was backwarded. Cost: a weak pointer and a pre-hook per returned tensor.
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <atomic>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

namespace ferry {

class ForwardOutputs {
 public:
  // A new iteration: nothing watched.
  void clear() { outputs_.clear(); }
  // Watches the autograd nodes of the tensors in `out` (under grad mode; a leaf or a tensor without a
  // graph has nothing saved for a backward).
  void note(const at::Tensor& out);
  void note(const std::vector<at::Tensor>& out) {
    for (const at::Tensor& t : out) note(t);
  }
  template <class A, class B>
  void note(const std::pair<A, B>& out) {
    note(out.first);
    note(out.second);
  }
  template <class... T>
  void note(const std::tuple<T...>& out) {
    std::apply([&](const auto&... t) { (note(t), ...); }, out);
  }
  template <class T>
  void note(const T&) {}
  // Some graph built by this iteration's forwards can still reach one of `params` (its gradient
  // accumulator, which only graphs hold, is alive) or a saved view of one (the node of a forward's
  // output is alive and no backward ran through it): a backward may follow (Note [Several forwards]).
  bool graph_awaits_backward(const std::vector<at::Tensor>& params) const;
  // Outputs watched (tests).
  size_t size() const { return outputs_.size(); }

 private:
  // The node of a forward output, with whether a backward that frees the graph has run through it (a
  // pre-hook on the node sets it).
  struct Output {
    std::weak_ptr<torch::autograd::Node> node;
    std::shared_ptr<std::atomic<bool>> ran;
  };
  std::vector<Output> outputs_;
};

}  // namespace ferry
