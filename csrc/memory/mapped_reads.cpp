// The SIGBUS guard behind guard_mapped_reads. A thread inside a guarded body has a recovery point; the
// handler jumps back to it when a read faults. Any other SIGBUS is not ours: the handler puts back the
// handler it replaced and lets the signal come again (a fault recurs when the read runs again, a sent
// signal is raised again), so whatever handled SIGBUS before (Python's faulthandler, or the default: the
// process dies) handles it as if fastcollate were not there.
#include "memory/mapped_reads.h"

#include <c10/util/Exception.h>

#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <mutex>

namespace fastcollate {

namespace {

thread_local sigjmp_buf* recovery_point = nullptr;
thread_local const void* fault_address = nullptr;

struct sigaction replaced_handler;
std::mutex installing;
volatile sig_atomic_t handed_back = 0;

void on_sigbus(int signal, siginfo_t* info, void* /*context*/) {
  // Ours: a guarded read of an address the file no longer backs. Not ours: a signal sent by kill or
  // pthread_kill (si_code <= 0, si_addr is no address then), a hardware memory error, any fault outside
  // a guarded body.
  sigjmp_buf* const point = recovery_point;
  if (point != nullptr && info->si_code == BUS_ADRERR) {
    fault_address = info->si_addr;
    siglongjmp(*point, 1);
  }
  // The replaced handler gets the signal: a fault raises it again when the read runs again, a sent signal
  // is sent again here. If that handler hands the signal back to this one, the default action ends the
  // process (no loop between the two).
  if (handed_back) {
    struct sigaction fallback{};
    fallback.sa_handler = SIG_DFL;
    sigemptyset(&fallback.sa_mask);
    sigaction(signal, &fallback, nullptr);
  } else {
    handed_back = 1;
    sigaction(signal, &replaced_handler, nullptr);
  }
  if (info->si_code <= 0) {
    raise(signal);
  }
}

bool is_ours(const struct sigaction& handler) {
  return (handler.sa_flags & SA_SIGINFO) != 0 && handler.sa_sigaction == &on_sigbus;
}

}  // namespace

void arm_mapped_read_guard() {
  struct sigaction current{};
  sigaction(SIGBUS, nullptr, &current);
  if (!is_ours(current)) {
    std::lock_guard<std::mutex> lock(installing);
    sigaction(SIGBUS, nullptr, &current);
    if (!is_ours(current)) {
      struct sigaction guard{};
      guard.sa_sigaction = &on_sigbus;
      // SA_NODEFER: the jump out of the handler does not restore the signal mask, so SIGBUS must not be
      // blocked while it runs (a second fault on that thread would then kill the process).
      guard.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
      sigemptyset(&guard.sa_mask);
      replaced_handler = current;
      handed_back = 0;
      sigaction(SIGBUS, &guard, nullptr);
    }
  }
}

namespace detail {

bool run_guarded(void (*body)(void*), void* context, const void** fault) {
  sigjmp_buf point;
  sigjmp_buf* const outer = recovery_point;  // guarded bodies may nest
  // savemask 0: no system call per body; SA_NODEFER keeps the mask as it was.
  if (sigsetjmp(point, 0) != 0) {
    recovery_point = outer;
    *fault = fault_address;
    return false;
  }
  recovery_point = &point;
  try {
    body(context);
  } catch (...) {
    recovery_point = outer;
    throw;
  }
  recovery_point = outer;
  return true;
}

void throw_mapped_read_fault(const void* fault) {
  TORCH_CHECK(false, kMappedReadFault, " at address ", fault,
              ": the file is now shorter than its mapping (truncated or rewritten while it was read)");
}

}  // namespace detail

}  // namespace fastcollate
