// Whether a process is still alive, asked of a pid read from shared memory: a shared slot's state word
// names the worker writing it, and a slot whose writer died is taken back.
#pragma once

#include <cstdint>

namespace fastcollate {

// True when `pid` is gone: no such process, or a zombie not yet reaped by its parent (it will never
// write again). A process this one may not signal (another user's) counts as alive.
bool process_is_gone(int64_t pid);

}  // namespace fastcollate
