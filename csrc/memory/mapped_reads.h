// Reads from memory-mapped files that cannot kill the process. A mapped file that shrinks (truncated, or
// rewritten in place) turns every read past its new end into SIGBUS; inside guard_mapped_reads such a read
// throws a c10::Error that starts with kMappedReadFault instead, on whichever thread it happened.
#pragma once

namespace fastcollate {

// The start of the error a faulted read raises: Python recognises it to name the column whose file it was.
constexpr const char* kMappedReadFault = "fastcollate: a read from a memory-mapped file faulted";

namespace detail {
// Runs body(context); returns false, with the faulting address in *fault, if a read inside it faulted.
bool run_guarded(void (*body)(void*), void* context, const void** fault);
[[noreturn]] void throw_mapped_read_fault(const void* fault);
}  // namespace detail

// Puts the guard's SIGBUS handler in front of whatever handles SIGBUS now (a handler installed since, by
// faulthandler.enable() or signal.signal, would take the guard's faults). One system call: call it on the
// calling thread once per op, before its guarded bodies run (on any thread).
void arm_mapped_read_guard();

// Runs `body` on this thread with SIGBUS turned into an error (arm_mapped_read_guard first). The body must own nothing
// that needs a destructor at the moment it reads (a fault leaves its frames without unwinding them): plain copy loops.
// Exceptions thrown by the body pass through unchanged.
template <typename Body>
void guard_mapped_reads(Body&& body) {
  const void* fault = nullptr;
  if (!detail::run_guarded([](void* context) { (*static_cast<Body*>(context))(); }, &body, &fault)) {
    detail::throw_mapped_read_fault(fault);
  }
}

}  // namespace fastcollate
