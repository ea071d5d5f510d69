#include "memory/process_liveness.h"

#include <signal.h>
#include <sys/types.h>

#include <cerrno>
#include <fstream>
#include <iterator>
#include <string>

namespace fastcollate {

bool process_is_gone(int64_t pid) {
  if (::kill(static_cast<pid_t>(pid), 0) != 0) {
    return errno == ESRCH;
  }
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos || close + 2 >= text.size()) {
    return false;
  }
  const char state = text[close + 2];
  return state == 'Z' || state == 'X';
}

}  // namespace fastcollate
