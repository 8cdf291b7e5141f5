#pragma once
// SLURM's compressed host lists, the form of SLURM_STEP_NODELIST and SLURM_JOB_NODELIST:
// "node[01-04,07],gpu-a1" names node01, node02, node03, node04, node07 and gpu-a1. Config::from_env
// reads the first host of a SLURM step's list as the rendezvous address when MASTER_ADDR is not set
// (srun starts task 0, rank 0, on the first node of its step; docs/ARCHITECTURE.md D97).
#include <string>
#include <string_view>

namespace ferry {

// The first host `list` names: "node[01-04,07],gpu1" -> "node01" (the digits as written, zero padding
// kept); a host with several bracket groups takes the first value of each ("r[2-3]n[5,7]" -> "r2n5").
// The whole list is checked first: entries separated by commas, none empty; brackets closed, not
// nested and not empty; each range "a" or "a-b" with decimal a <= b (at most 18 digits); no spaces.
// Otherwise fails naming `what` (the variable the list came from), the list and the offset.
std::string first_host(std::string_view list, std::string_view what);

}  // namespace ferry
