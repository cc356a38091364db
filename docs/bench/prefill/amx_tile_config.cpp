// ggml's AMX tile configuration (ggml/src/ggml-cpu/amx/mmq.cpp, ggml_tile_config_init), alone.
// GCC 12.2 (Debian 12's g++) at -O2/-O3 drops the stores to `tc` before _tile_loadconfig: the LDTILECFG
// then reads palette 1 with rows/colsb left from the stack and faults (#GP, SIGSEGV), the crash of
// ggml-org/llama.cpp issue 20824 on AMX Xeons. -fno-dse (or another compiler) keeps the stores.
//
//   g++ -O2 -march=native amx_tile_config.cpp -o t && ./t              # GCC 12.2: Segmentation fault
//   g++ -O2 -march=native -fno-dse amx_tile_config.cpp -o t && ./t     # "tile config loaded"
//   g++ -O2 -march=native -S -o - amx_tile_config.cpp | grep -B4 ldtilecfg   # the stores are missing
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

struct tile_config_t {
    uint8_t palette_id = 0;
    uint8_t start_row = 0;
    uint8_t reserved_0[14] = {0};
    uint16_t colsb[16] = {0};
    uint8_t rows[16] = {0};
};

__attribute__((noinline)) void dirty_stack() {  // what a thread's stack holds before: not zeros
    volatile uint8_t junk[256];
    for (int i = 0; i < 256; ++i) junk[i] = 0x30;
}

__attribute__((noinline)) void tile_config_init() {
    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1;
    tc.rows[0] = 8;   tc.colsb[0] = 64;
    tc.rows[1] = 8;   tc.colsb[1] = 64;
    tc.rows[2] = 16;  tc.colsb[2] = 32;
    tc.rows[3] = 16;  tc.colsb[3] = 32;
    tc.rows[4] = 16;  tc.colsb[4] = 64;
    tc.rows[5] = 16;  tc.colsb[5] = 64;
    tc.rows[6] = 16;  tc.colsb[6] = 64;
    tc.rows[7] = 16;  tc.colsb[7] = 64;
    _tile_loadconfig(&tc);
}

int main() {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) {
        printf("AMX not permitted here\n");
        return 2;
    }
    dirty_stack();
    tile_config_init();
    _tile_release();
    printf("tile config loaded\n");
    return 0;
}
