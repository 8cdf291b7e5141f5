#include "process_group.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../chunk/device.h"
#include "../common/cli.h"
#include "../common/event_trace.h"
#include "../common/logging.h"
#include "nccl.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef FERRY_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

namespace ferry::dist {

namespace {

using Clock = std::chrono::steady_clock;

std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << t.numel() << " " << t.scalar_type() << " on " << t.device();
  return os.str();
}

// The collectives over one c10d backend, whose tensors live on `device` (Gloo: the CPU; NCCL: this
// rank's GPU). Every wait is Work::wait(dist-timeout); a failure (a dead or silent peer) is rethrown
// naming the operation, this rank and the timeout. NCCL is handed CPU tensors too: they are staged
// through the GPU (the small scalars of the norms, the checks and the saves; D49).
// Note [Waiting for NCCL]: ProcessGroupNCCL's wait with a timeout makes the calling thread's current
// stream wait for the collective (an event, no host stall) and then blocks the host until the
// collective itself has completed on the GPU. So when it returns the outputs are written for the host
// and for every stream, while the compute queued on the current stream before the collective keeps
// running: the host is not made to drain it (until 2026-11-23 every wait also synchronized the current
// stream, which emptied the GPU's queue at each gather). A staged CPU output is copied back after the
// wait, a copy that the host waits for.
class C10dCommunicator final : public Communicator {
 public:
  C10dCommunicator(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Backend> backend, int rank,
                   int world, std::chrono::milliseconds timeout, std::string name, c10::Device device)
      : store_(std::move(store)),
        backend_(std::move(backend)),
        rank_(rank),
        world_(world),
        timeout_(timeout),
        name_(std::move(name)),
        device_(device) {}

  ~C10dCommunicator() override {
    try {
      backend_->shutdown();  // NCCL: its communicators and watchdog end here, not at exit
    } catch (const std::exception& e) {
      log::warn("ferry: shutting down the ", name_, " process group: ", cli::message_of(e));
    }
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend() const override { return name_; }
  bool device_ok(const c10::Device& device) const override {
    return device.is_cpu() || (device.type() == device_.type() && device.index() == device_.index());
  }

  void all_reduce(at::Tensor& tensor, ReduceOp op) override {
    check(tensor, "all_reduce");
    c10d::AllreduceOptions o;
    o.reduceOp = op == ReduceOp::kSum ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX;
    o.timeout = timeout_;
    std::vector<at::Tensor> ts{staged(tensor)};
    run("all_reduce", tensor, [&] { return backend_->allreduce(ts, o); });
    if (!ts[0].is_same(tensor)) tensor.copy_(ts[0]);
    const int64_t bytes = tensor.nbytes();
    stats_.all_reduce_bytes += bytes;
    stats_.ring_bytes_sent += 2 * ring_share(bytes);
  }

  void broadcast(at::Tensor& tensor, int root) override {
    check(tensor, "broadcast");
    TORCH_CHECK(root >= 0 && root < world_, "ferry: broadcast root ", root, " out of range [0, ", world_, ")");
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.timeout = timeout_;
    std::vector<at::Tensor> ts{staged(tensor)};
    run("broadcast", tensor, [&] { return backend_->broadcast(ts, o); });
    if (!ts[0].is_same(tensor)) tensor.copy_(ts[0]);
    stats_.broadcast_bytes += tensor.nbytes();
    stats_.ring_bytes_sent += ring_share(tensor.nbytes());
  }

  void reduce_scatter(at::Tensor& output, const at::Tensor& input) override {
    reduce_scatter_async(output, input)->wait();
  }

  void all_gather(at::Tensor& output, const at::Tensor& input) override { all_gather_async(output, input)->wait(); }

  std::unique_ptr<Pending> reduce_scatter_async(const at::Tensor& output, const at::Tensor& input) override {
    check(output, "reduce_scatter");
    check(input, "reduce_scatter");
    TORCH_CHECK(input.numel() == output.numel() * world_ && input.scalar_type() == output.scalar_type(),
                "ferry: reduce_scatter needs an input of world size (", world_, ") x the output's elements of "
                "its dtype; got input ", describe(input), ", output ", describe(output));
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    o.timeout = timeout_;
    at::Tensor out = staged(output, /*copy=*/false), in = staged(input);
    auto pending = start("reduce_scatter", output, out, in, [&] { return backend_->_reduce_scatter_base(out, in, o); });
    stats_.reduce_scatter_bytes += input.nbytes();
    stats_.ring_bytes_sent += ring_share(input.nbytes());
    return pending;
  }

  std::unique_ptr<Pending> all_gather_async(const at::Tensor& output, const at::Tensor& input) override {
    check(output, "all_gather");
    check(input, "all_gather");
    TORCH_CHECK(output.numel() == input.numel() * world_ && input.scalar_type() == output.scalar_type(),
                "ferry: all_gather needs an output of world size (", world_, ") x the input's elements of its "
                "dtype; got input ", describe(input), ", output ", describe(output));
    c10d::AllgatherOptions o;
    o.timeout = timeout_;
    at::Tensor out = staged(output, /*copy=*/false), in = staged(input);
    auto pending = start("all_gather", output, out, in, [&] { return backend_->_allgather_base(out, in, o); });
    stats_.all_gather_bytes += output.nbytes();
    stats_.ring_bytes_sent += ring_share(output.nbytes());
    return pending;
  }

  void barrier() override {
    c10d::BarrierOptions o;
    o.timeout = timeout_;
    at::Tensor none;
    run("barrier", none, [&] { return backend_->barrier(o); });
  }

 private:
  int64_t ring_share(int64_t bytes) const { return bytes / world_ * (world_ - 1); }

  void check(const at::Tensor& t, const char* op) const {
    TORCH_CHECK(t.defined() && t.is_contiguous(), "ferry: ", op, " needs a defined contiguous tensor");
    TORCH_CHECK(device_ok(t.device()), "ferry: ", op, " over ", name_, " needs tensors on the CPU",
                device_.is_cpu() ? std::string() : " or " + device_.str(), "; got ", describe(t));
  }

  // `t` where the backend reads it: itself, or (NCCL, a CPU tensor) a copy on the device, its values
  // copied too unless `copy` is false (an output).
  at::Tensor staged(const at::Tensor& t, bool copy = true) const {
    if (t.device() == device_) return t;
    return copy ? t.to(device_) : at::empty_like(t, t.options().device(device_));
  }

  // A collective in flight. `out` is the caller's output; `staged_out` the one the backend writes (the
  // same tensor, or its device copy, written back on wait).
  class C10dPending final : public Pending {
   public:
    C10dPending(C10dCommunicator* comm, const char* op, c10::intrusive_ptr<c10d::Work> work, at::Tensor out,
                at::Tensor staged_out, at::Tensor in)
        : comm_(comm),
          op_(op),
          work_(std::move(work)),
          out_(std::move(out)),
          staged_out_(std::move(staged_out)),
          in_(std::move(in)) {}
    ~C10dPending() override {
      try {
        wait();
      } catch (const std::exception& e) {
        log::error("ferry: a collective in flight failed while it was abandoned: ", cli::message_of(e));
      }
    }
    void wait() override {
      if (!work_) return;
      trace::Span span("dist", trace::enabled() ? std::string("wait ") + op_ : std::string());
      const auto t0 = Clock::now();
      c10::intrusive_ptr<c10d::Work> work = std::move(work_);
      try {
        work->wait(comm_->timeout_);  // Note [Waiting for NCCL]
        if (!staged_out_.is_same(out_)) out_.copy_(staged_out_);
      } catch (const std::exception& e) {
        comm_->fail(op_, in_, e);
      }
      comm_->async_wait_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
    }

   private:
    C10dCommunicator* comm_;
    const char* op_;
    c10::intrusive_ptr<c10d::Work> work_;
    at::Tensor out_, staged_out_, in_;
  };

  // Launches a collective; its Pending waits for it. Counts it.
  template <typename Launch>
  std::unique_ptr<Pending> start(const char* op, const at::Tensor& out, const at::Tensor& staged_out,
                                 const at::Tensor& in, Launch&& launch) {
    TORCH_CHECK(!broken_.load(), "ferry: rank ", rank_, " of ", world_, ": the process group failed earlier; it "
                "cannot be used again");
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = launch();
    } catch (const std::exception& e) {
      fail(op, in, e);
    }
    ++stats_.collectives;
    return std::make_unique<C10dPending>(this, op, std::move(work), out, staged_out, in);
  }

  [[noreturn]] void fail(const char* op, const at::Tensor& what, const std::exception& e) {
    broken_ = true;
    TORCH_CHECK(false, "ferry: rank ", rank_, " of ", world_, ": ", op,
                what.defined() ? " of " + describe(what) : std::string(), " over ", name_,
                " failed: a rank died, or did not take part within dist-timeout (", timeout_.count() / 1000.0,
                " s). Cause: ", cli::message_of(e));
  }

  // Note [A collective lets go of its tensors]. A backend's worker can hold a finished work, and with it
  // the tensors it names, a moment after wait() returns: Gloo's marks the future done, then resets its
  // in-progress slot. A caller that counts the references to a chunk right after (the warm-up repack's
  // check, Note [A repack waits for held views]: the masters broadcast at construction are state chunk
  // memory) saw the worker's as a view held outside (seen once under load: a repack that waited for
  // nothing, and at N > 1 every rank's first step refused). So a blocking Gloo collective returns once
  // the work is the caller's alone; bounded, since nothing is wrong if a backend keeps it longer. Not
  // NCCL: its tensors are device tensors or staged device copies of host ones (the masters' broadcast),
  // and how long its watchdog keeps a work is unobserved here: a wait there could cost every step.
  static void await_release(const c10::intrusive_ptr<c10d::Work>& work, const char* op) {
    const auto deadline = Clock::now() + std::chrono::seconds(1);
    while (work.use_count() > 1) {
      if (Clock::now() > deadline) {
        log::debug("ferry: the backend still holds a finished ", op, " after 1 s; going on");
        return;
      }
      std::this_thread::yield();
    }
  }

  template <typename Launch>
  void run(const char* op, const at::Tensor& what, Launch&& launch) {
    TORCH_CHECK(!broken_.load(), "ferry: rank ", rank_, " of ", world_, ": the process group failed earlier; it "
                "cannot be used again");
    trace::Span span("dist", op);
    const auto t0 = Clock::now();
    try {
      c10::intrusive_ptr<c10d::Work> work = launch();
      work->wait(timeout_);  // Note [Waiting for NCCL]
      if (name_ == "gloo") await_release(work, op);
    } catch (const std::exception& e) {
      fail(op, what, e);
    }
    ++stats_.collectives;
    stats_.wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
  }

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  int rank_, world_;
  std::chrono::milliseconds timeout_;
  std::string name_;
  c10::Device device_;
  std::atomic<bool> broken_{false};
};

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr == "::1" || addr.rfind("127.", 0) == 0;
}

// Every rank says which rank it is and what world size it was launched with; each checks all of them.
void check_launch(c10d::Store& store, const Config& config, std::chrono::milliseconds timeout) {
  const std::string me = std::to_string(config.rank);
  const int64_t claims = store.add("ferry/launch/claims/" + me, 1);
  TORCH_CHECK(claims == 1, "ferry: two processes claim rank ", config.rank, " of this job (", claims,
              " so far): check RANK / SLURM_PROCID / --rank of each process");
  store.set("ferry/launch/world/" + me, std::to_string(config.world_size));
  std::vector<std::string> keys;
  for (int r = 0; r < config.world_size; ++r) keys.push_back("ferry/launch/world/" + std::to_string(r));
  try {
    store.wait(keys, timeout);
  } catch (const std::exception& e) {
    std::vector<std::string> missing;
    for (int r = 0; r < config.world_size; ++r) {
      try {
        if (!store.check({keys[r]})) missing.push_back(std::to_string(r));
      } catch (const std::exception&) {
        missing.push_back(std::to_string(r) + "?");
      }
    }
    std::ostringstream os;
    for (size_t i = 0; i < missing.size(); ++i) os << (i ? ", " : "") << missing[i];
    TORCH_CHECK(false, "ferry: rank ", config.rank, ": not every rank of world size ", config.world_size,
                " joined within dist-timeout (", timeout.count() / 1000.0, " s); missing rank(s): ", os.str(),
                ". Were they started, with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE? (", cli::message_of(e), ")");
  }
  for (int r = 0; r < config.world_size; ++r) {
    const std::vector<uint8_t> v = store.get(keys[r]);
    const std::string theirs(v.begin(), v.end());
    TORCH_CHECK(theirs == std::to_string(config.world_size), "ferry: ranks disagree on the world size: rank ", r,
                " was launched with WORLD_SIZE=", theirs, ", rank ", config.rank, " with ", config.world_size,
                ". Launch every process with the same world size.");
  }
}

#ifdef FERRY_WITH_GLOO
using GlooDevices = std::vector<std::shared_ptr<::gloo::transport::Device>>;

// The network devices Gloo binds: the interfaces GLOO_SOCKET_IFNAME names, as torch.distributed binds
// them (a host with several networks); otherwise loopback when the whole job is on this host by its
// master address, else the address this host's name resolves to. Made before the rendezvous, so that
// an interface this host lacks fails every rank on its own, not the others through a closed store.
GlooDevices gloo_devices(const Config& config) {
  GlooDevices devices;
  for (const std::string& name : config.gloo_interfaces) {
    try {
      devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "ferry: rank ", config.rank, ": GLOO_SOCKET_IFNAME names the network interface '", name,
                  "', which Gloo cannot bind on this host (", cli::message_of(e), "); name one that `ip addr` lists");
    }
  }
  if (devices.empty()) {
    devices.push_back(is_loopback(config.master_addr) ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                                      : c10d::ProcessGroupGloo::createDefaultDevice());
  }
  return devices;
}

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, const Config& config,
                                                    std::chrono::milliseconds timeout, const GlooDevices& devices) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices = devices;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, config.rank, config.world_size, options);
}
#else
struct GlooDevices {};
GlooDevices gloo_devices(const Config&) { return {}; }
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>&, const Config&,
                                                    std::chrono::milliseconds, const GlooDevices&) {
  TORCH_INTERNAL_ASSERT(false, "choose_backend() refuses gloo in a build without it");
}
#endif

// The backend a run uses: "auto" is NCCL where the chunks' device runs NCCL's collectives in place (CUDA)
// and ferry has NCCL, else Gloo.
std::string choose_backend(const Config& config, const Device& device) {
  const bool nccl_device = std::string(device.collective_backend()) == "nccl";
  if (config.dist_backend == "auto" && nccl_device && detail::have_nccl()) return "nccl";
  if (config.dist_backend == "nccl") {
    TORCH_CHECK(detail::have_nccl(), "ferry: dist-backend 'nccl' is not built into this ferry (it needs a CUDA "
                "build of LibTorch and nccl.h at build time); use gloo");
    TORCH_CHECK(nccl_device, "ferry: dist-backend 'nccl' needs the chunks on CUDA devices, but this run's device is ",
                device.name(), "; use gloo (or auto)");
    return "nccl";
  }
  TORCH_CHECK(have_gloo(), "ferry was built without Gloo's headers (Debian: libgloo-dev; scripts/setup.sh installs "
              "them), so it cannot run world size ", config.world_size, " over gloo; rebuild after installing them");
  return "gloo";
}

}  // namespace

bool have_gloo() {
#ifdef FERRY_WITH_GLOO
  return true;
#else
  return false;
#endif
}

bool have_nccl() { return detail::have_nccl(); }

std::shared_ptr<Communicator> connect(const Config& config, bool even_alone) {
  config.validate();
  // Its lines carry this rank, at the Config's level, unless the program configured the log itself.
  log::configure_default(config.log_level, config.rank);
  TORCH_CHECK(config.launcher != Launcher::kSlurmBatch || config.world_size == 1, "ferry: SLURM gave this job ",
              config.world_size, " tasks (SLURM_NTASKS), but this process was not started by srun (no "
              "SLURM_STEP_NUM_TASKS): it is the batch script itself, one process, and the other ranks would never "
              "come. Start the program with srun (`srun PROGRAM ...`, one task per rank), or pass --world-size=1 to "
              "run it alone");
  if (config.world_size == 1 && !even_alone) return nullptr;
  const std::shared_ptr<const Device> chunks_device = make_device(config.device);
  const std::string backend = choose_backend(config, *chunks_device);
  // One rank per GPU: this process's device is its local rank's, before any chunk is placed, or the
  // one GPU its launcher left visible to it (srun --gpus-per-task=1: each task sees only its own).
  // (NCCL refuses two ranks on one GPU; Gloo does not mind, so several ranks may share one there.)
  const int unit = config.visible_gpus == 1 ? 0 : config.local_rank;
  const c10::Device device = chunks_device->bind_local_rank(unit, /*may_share=*/backend == "gloo");
  const bool cuda = device.is_cuda();
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(config.dist_timeout_s * 1000.0));
  const GlooDevices gloo = backend == "gloo" ? gloo_devices(config) : GlooDevices{};
  const bool serve = config.rank == 0 && !config.agent_store;
  const std::string found_at =
      config.master_addr_from.empty() ? std::string() : " (the first node of " + config.master_addr_from + ")";
  log::info("ferry: rank ", config.rank, " of ", config.world_size, " joining ", config.master_addr, ":",
            config.master_port, found_at, serve ? " (serving the store)" : "", " over ", backend,
            cuda ? " on " + device.str() : std::string());
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(config.master_port);
  store_options.isServer = serve;
  store_options.waitWorkers = false;  // check_launch waits, with a message that says who is missing
  store_options.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(config.master_addr, store_options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "ferry: rank ", config.rank, " could not ", serve ? "serve" : "reach", " the rendezvous store at ",
                config.master_addr, ":", config.master_port, " within dist-timeout (", config.dist_timeout_s,
                " s)", found_at, ": ",
                serve                             ? "is the port free?"
                : config.master_addr_from.empty() ? "is rank 0 (or torchrun) running there, and are MASTER_ADDR / "
                                                    "MASTER_PORT right?"
                                                  : "is rank 0 running there? srun starts task 0 on the step's first "
                                                    "node unless a hostfile or --distribution places it elsewhere; "
                                                    "then export MASTER_ADDR",
                " (", cli::message_of(e), ")");
  }
  check_launch(*store, config, timeout);
  c10::intrusive_ptr<c10d::Backend> pg;
  const auto prefixed = c10::make_intrusive<c10d::PrefixStore>("ferry/" + backend, store);
  try {
    pg = backend == "nccl" ? detail::make_nccl_backend(prefixed, config.rank, config.world_size, timeout, device)
                           : make_gloo_backend(prefixed, config, timeout, gloo);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "ferry: rank ", config.rank, " of ", config.world_size, " could not connect ", backend,
                " to the other ranks within dist-timeout (", config.dist_timeout_s, " s): ", cli::message_of(e));
  }
  auto comm = std::make_shared<C10dCommunicator>(store, pg, config.rank, config.world_size, timeout, backend,
                                                 backend == "nccl" ? device : c10::Device(c10::kCPU));
  comm->barrier();
  log::info("ferry: rank ", config.rank, " of ", config.world_size, " connected (", backend, ")");
  return comm;
}

}  // namespace ferry::dist
