// Diagnostics for machines without a GPU (CI): every typed launcher of
// ncdp::kernels can be run once with tiny sizes, so that a host launcher whose
// body nvcc replaced by exit(1) (a host template calling a __device__-only
// helper, issue 14) ends a test's subprocess instead of a user's process.
#pragma once
#include <string>
#include <vector>

namespace ncdp {

// Names of the typed launchers the probe covers, one per template
// instantiation, e.g. "row_sq_norms<float>", "hadamard_gram<float,double,float>".
std::vector<std::string> typed_launcher_names();

// Runs launcher `name` (one of typed_launcher_names()) on stream 0 for each of
// its probe cases (sizes chosen to reach every launch branch, all non-empty).
// With a device, on zeroed device buffers freed afterwards; returns normally
// when every launch and the following cudaDeviceSynchronize succeed. Without
// one, on null pointers: each launch must fail before any kernel runs, and the
// failure is raised as RuntimeError naming the CUDA error (cudaErrorNoDevice,
// cudaErrorInsufficientDriver, ...). A launcher that returns without
// attempting a launch also raises, naming the case. Unknown names raise
// ValueError.
void probe_typed_launcher(const std::string& name);

}  // namespace ncdp
