// AMX's tile registers, where the CPU has them: Linux hands out their state only to a process that asks for it.
#pragma once

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>

namespace kvserve {

// Asked once per process (the permission then covers all its threads); false where the kernel refuses.
inline bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

}  // namespace kvserve
#endif
