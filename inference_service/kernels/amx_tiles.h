// AMX tile operations for the int8 kernels: the hardware's intrinsics in builds with AMX-INT8, or, with
// LORAPLEX_AMX_EMULATE, an exact C model of the same instructions (Intel SDM's pseudo-code for
// LDTILECFG, TILELOADD, TILESTORED, TILEZERO and TDPBSUD), so that a host without AMX compiles, runs and
// tests the very kernel code an AMX host runs (tests/test_quantized_weights.py). The model also checks
// what the hardware faults on (an unconfigured tile, shapes that do not fit together, more than 16
// rows or 64 bytes a row) and counts it in `amx_tile_faults` instead.
//
// Tile numbers are constants, as the intrinsics require: AMX_LOAD(3, p, stride) and so on.
#ifndef LORAPLEX_AMX_TILES_H
#define LORAPLEX_AMX_TILES_H

#include <stdint.h>
#include <string.h>

#include "common.h"

#if defined(LORAPLEX_AMX) && defined(__AMX_INT8__) && defined(__AVX512VNNI__) && !defined(LORAPLEX_AMX_EMULATE)
#define LORAPLEX_AMX_INT8 1
#define AMX_FAULTS() 0  // the hardware traps instead
#define AMX_CONFIGURE(cfg) _tile_loadconfig(cfg)
#define AMX_RELEASE() _tile_release()
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define AMX_STORE(t, p, stride) _tile_stored(t, p, stride)
#define AMX_DPBSUD(c, a, b) _tile_dpbsud(c, a, b)  // c += a (signed int8) . b (unsigned int8), groups of 4

static inline int amx_int8_permitted(void) { return amx_permitted(); }

#elif defined(LORAPLEX_AMX_EMULATE) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LORAPLEX_AMX_INT8 1

typedef struct {
    int configured;
    tile_config cfg;
    uint8_t data[8][16][64];  // 8 tiles of at most 16 rows of 64 bytes
} amx_tile_state;

static __thread amx_tile_state amx_tiles;
static int amx_tile_faults;  // shape or configuration errors the hardware would fault on

static inline int amx_int8_permitted(void) { return 1; }

static inline int amx_tile_ok(int t) {
    const int ok = amx_tiles.configured && t >= 0 && t < 8 && amx_tiles.cfg.rows[t] >= 1 &&
                   amx_tiles.cfg.rows[t] <= 16 && amx_tiles.cfg.colsb[t] >= 1 && amx_tiles.cfg.colsb[t] <= 64;
    if (!ok) __atomic_add_fetch(&amx_tile_faults, 1, __ATOMIC_RELAXED);
    return ok;
}

static inline void amx_configure(const tile_config *cfg) {
    amx_tiles.cfg = *cfg;
    amx_tiles.configured = cfg->palette == 1;
    if (!amx_tiles.configured) __atomic_add_fetch(&amx_tile_faults, 1, __ATOMIC_RELAXED);
    memset(amx_tiles.data, 0, sizeof amx_tiles.data);  // LDTILECFG zeroes every tile
}

static inline void amx_release(void) {
    amx_tiles.configured = 0;
    memset(amx_tiles.data, 0, sizeof amx_tiles.data);
}

static inline void amx_zero(int t) {
    if (amx_tile_ok(t)) memset(amx_tiles.data[t], 0, sizeof amx_tiles.data[t]);
}

// TILELOADD: `rows` rows of `colsb` bytes, row r from p + r * stride; the rest of the tile zero.
static inline void amx_load(int t, const void *p, int64_t stride) {
    if (!amx_tile_ok(t)) return;
    memset(amx_tiles.data[t], 0, sizeof amx_tiles.data[t]);
    for (int r = 0; r < amx_tiles.cfg.rows[t]; r++)
        memcpy(amx_tiles.data[t][r], (const uint8_t *)p + r * stride, amx_tiles.cfg.colsb[t]);
}

static inline void amx_store(int t, void *p, int64_t stride) {
    if (!amx_tile_ok(t)) return;
    for (int r = 0; r < amx_tiles.cfg.rows[t]; r++)
        memcpy((uint8_t *)p + r * stride, amx_tiles.data[t][r], amx_tiles.cfg.colsb[t]);
}

// TDPBSUD: c[m][n] += sum over k < colsb(a) / 4, i < 4 of a[m][4k + i] (signed) x b[k][4n + i] (unsigned),
// in int32 without saturation; c's rows must be a's, b's rows colsb(a) / 4, b's bytes a row c's.
static inline void amx_dpbsud(int c, int a, int b) {
    if (!amx_tile_ok(c) || !amx_tile_ok(a) || !amx_tile_ok(b)) return;
    const tile_config *cfg = &amx_tiles.cfg;
    if (cfg->rows[c] != cfg->rows[a] || cfg->colsb[a] % 4 || cfg->rows[b] != cfg->colsb[a] / 4 ||
        cfg->colsb[b] != cfg->colsb[c] || cfg->colsb[c] % 4) {
        __atomic_add_fetch(&amx_tile_faults, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int m = 0; m < cfg->rows[c]; m++) {
        for (int n = 0; n < cfg->colsb[c] / 4; n++) {
            uint32_t sum;
            memcpy(&sum, &amx_tiles.data[c][m][4 * n], 4);
            for (int k = 0; k < cfg->colsb[a] / 4; k++)
                for (int i = 0; i < 4; i++)
                    sum += (uint32_t)((int32_t)(int8_t)amx_tiles.data[a][m][4 * k + i] *
                                      (int32_t)amx_tiles.data[b][k][4 * n + i]);
            memcpy(&amx_tiles.data[c][m][4 * n], &sum, 4);
        }
    }
}

#define AMX_CONFIGURE(cfg) amx_configure(cfg)
#define AMX_RELEASE() amx_release()
#define AMX_ZERO(t) amx_zero(t)
#define AMX_LOAD(t, p, stride) amx_load(t, p, stride)
#define AMX_STORE(t, p, stride) amx_store(t, p, stride)
#define AMX_DPBSUD(c, a, b) amx_dpbsud(c, a, b)
#define AMX_FAULTS() __atomic_load_n(&amx_tile_faults, __ATOMIC_RELAXED)
#endif

#endif
