// One emulation program serving many cases: `PROGRAM --serve` reads one case
// per line of stdin, runs it, and answers "done" on stdout; it exits at the
// first case that fails (its status), at end of input (0), or where a
// sanitizer halts it.
//
// Why: under ThreadSanitizer most of a case's time was the process's start:
// the emulator's 256 worker threads and each block's fibers are created once
// per process (tests/cuda_emu/cuda_emu.h, Pool and Fibers), and a process per
// case created them for every case. Kept across cases they are what they are
// across the launches of one case: a reused identity orders nothing that the
// launch boundary does not (cuda_emu.h). A case's buffers are fresh
// allocations, which the sanitizers treat as never accessed.
//
// LeakSanitizer runs at a process's exit; served, each case ends with a leak
// check of its own, and a leak fails that case with ASan's exit status.
#pragma once

#include <cstdio>
#include <iostream>
#include <string>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

namespace ncdp_emu {

// AddressSanitizer's exit status in tests/emulation.py (ASAN_OPTIONS exitcode).
constexpr int kLeakExitStatus = 67;

// Runs run_case(line) for each non-empty line of stdin; see the file comment.
template <typename RunCase>
int serve(const RunCase& run_case) {
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    const int status = run_case(line);
    if (status != 0) return status;
#if defined(__SANITIZE_ADDRESS__)
    if (__lsan_do_recoverable_leak_check() != 0) return kLeakExitStatus;
#endif
    std::fflush(stderr);
    std::fputs("done\n", stdout);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace ncdp_emu
