// The AMX parts that bf16_linear.cpp and group_linear.cpp share: the operand of
// LDTILECFG and Linux's permission to use the tile data. Each kernel includes it where
// it compiles its AMX path, and sets the tiles' shapes itself.
//
// A change here rebuilds both kernels: cpp_extension.py's build digest covers the
// headers a source includes with quotes.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pagedserve_amx {

// The 64-byte operand of LDTILECFG: palette 1, then each tile's bytes per row and rows.
struct TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "the LDTILECFG operand is 64 bytes");

// LDTILECFG of `config`. GCC 12 does not count the intrinsic's operand as read and may drop
// the stores that fill it, leaving the tiles unconfigured (the next tile instruction is
// then an illegal one, SIGILL): the barrier makes every store land first.
inline void load_tile_config(const TileConfig& config) {
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// Whether Linux lets this process use the AMX tile data (asked once per process).
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr int kXtiledata = 18;         // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return permitted;
}

}  // namespace pagedserve_amx
