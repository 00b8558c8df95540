/* The perturbation stream's hot loops in C: Philox4x64-10 words and fused multi-seed adds.
 *
 * Loaded with ctypes by shared/model/zkernel.py (no Python.h needed, so it builds wherever a C
 * compiler with 128-bit integers exists); the numpy path in stream.py stays the reference and
 * the fallback. The stream and the arithmetic are the contract of docs/protocol.md, section 1:
 *   block j of the stream of (seed, tid) = Philox4x64-10 at counter (j + 1, 0, 0, 0), key (seed, tid)
 *   element i = bit (i mod 64) of word floor(i / 64) of the stream; bit 0 -> +1, bit 1 -> -1
 *   replay: x = fl32(x + c * z) for each seed in order, c a float32.
 * Since z = +-1, c * z is c with its sign bit flipped where the bit is 1 (exact, also for
 * c = 0 -> -0.0 and infinities), so each step is one IEEE float32 addition, whatever the
 * vector width. Build without -ffast-math: the additions must not be reassociated or flushed.
 */
#include <stdint.h>
#include <string.h>

#if !defined(__SIZEOF_INT128__)
#error "the seedfed stream kernel needs 128-bit integers (64x64->128 multiply)"
#endif

#define SF_M0 0xD2E7470EE14C6C93ULL
#define SF_M1 0xCA5A826395121157ULL
#define SF_W0 0x9E3779B97F4A7C15ULL
#define SF_W1 0xBB67AE8584CAA73BULL
#define SF_BLOCK 256
/* A tile of 16 blocks = 4096 float32 = 16 KiB: stays in L1 while every seed is added to it. */
#define SF_TILE_BLOCKS 16
#define SF_MAX_SEEDS_PER_PASS 64

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define SF_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SF_CLONES
#endif

typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));

/* Round keys of one (seed, tid): 10 pairs, bumped by the Weyl constants between rounds. */
typedef struct { uint64_t k0[10], k1[10]; } sf_keys;

static inline void sf_make_keys(uint64_t seed, uint64_t tid, sf_keys *keys) {
    uint64_t k0 = seed, k1 = tid;
    for (int r = 0; r < 10; r++) {
        if (r) { k0 += SF_W0; k1 += SF_W1; }
        keys->k0[r] = k0;
        keys->k1[r] = k1;
    }
}

static inline void sf_block(const sf_keys *keys, uint64_t block, uint64_t out[4]) {
    uint64_t c0 = block + 1, c1 = 0, c2 = 0, c3 = 0;
    if (c0 == 0) c1 = 1; /* the 256-bit counter carries, as numpy's Philox does */
    for (int r = 0; r < 10; r++) {
        unsigned __int128 p0 = (unsigned __int128)SF_M0 * c0;
        unsigned __int128 p1 = (unsigned __int128)SF_M1 * c2;
        uint64_t n0 = (uint64_t)(p1 >> 64) ^ c1 ^ keys->k0[r];
        uint64_t n2 = (uint64_t)(p0 >> 64) ^ c3 ^ keys->k1[r];
        c1 = (uint64_t)p1;
        c3 = (uint64_t)p0;
        c0 = n0;
        c2 = n2;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

/* Words of blocks [first_block, first_block + n_blocks): 4 per block, in stream order. */
void sf_words(uint64_t seed, uint64_t tid, int64_t first_block, int64_t n_blocks, uint64_t *out) {
    sf_keys keys;
    sf_make_keys(seed, tid, &keys);
    for (int64_t b = 0; b < n_blocks; b++) sf_block(&keys, (uint64_t)(first_block + b), out + 4 * b);
}

/* Words of arbitrary blocks (any order): out[4 * i .. 4 * i + 3] is block blocks[i]. */
void sf_words_at(uint64_t seed, uint64_t tid, const int64_t *blocks, int64_t n, uint64_t *out) {
    sf_keys keys;
    sf_make_keys(seed, tid, &keys);
    for (int64_t i = 0; i < n; i++) sf_block(&keys, (uint64_t)blocks[i], out + 4 * i);
}

/* Lane j of BITS[q] selects bit 8q + j of a 32-bit half word. */
static const u32x8 SF_BITS[4] = {
    {1u << 0, 1u << 1, 1u << 2, 1u << 3, 1u << 4, 1u << 5, 1u << 6, 1u << 7},
    {1u << 8, 1u << 9, 1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15},
    {1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21, 1u << 22, 1u << 23},
    {1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31},
};

/* c * z for the 32 elements of one half word, as 4 vectors of sign-flipped copies of c. */
static inline void sf_half(uint32_t half, u32x8 cbits, f32x8 add[4]) {
    const u32x8 sign = {0x80000000u, 0x80000000u, 0x80000000u, 0x80000000u,
                        0x80000000u, 0x80000000u, 0x80000000u, 0x80000000u};
    u32x8 h = {half, half, half, half, half, half, half, half};
    for (int q = 0; q < 4; q++) {
        u32x8 set = (u32x8)((h & SF_BITS[q]) != 0); /* all ones where the bit is 1 */
        u32x8 v = cbits ^ (set & sign);
        memcpy(&add[q], &v, sizeof v);
    }
}

static inline void sf_add_word(float *x, uint64_t word, u32x8 cbits) {
    f32x8 add[4], v;
    for (int h = 0; h < 2; h++) {
        sf_half((uint32_t)(word >> (32 * h)), cbits, add);
        for (int q = 0; q < 4; q++) {
            float *p = x + 32 * h + 8 * q;
            memcpy(&v, p, sizeof v);
            v = v + add[q];
            memcpy(p, &v, sizeof v);
        }
    }
}

static inline u32x8 sf_splat_bits(float c) {
    uint32_t b;
    memcpy(&b, &c, sizeof b);
    u32x8 v = {b, b, b, b, b, b, b, b};
    return v;
}

/* Elements past a tensor's end inside its last block: scalar, one element at a time. */
static inline void sf_add_tail(float *x, const uint64_t *words, int64_t count, float c) {
    uint32_t cb;
    memcpy(&cb, &c, sizeof cb);
    for (int64_t i = 0; i < count; i++) {
        uint32_t v = cb ^ ((uint32_t)((words[i >> 6] >> (i & 63)) & 1u) << 31);
        float a;
        memcpy(&a, &v, sizeof a);
        x[i] += a;
    }
}

/* dst[i] = src[i] + sum over s in order of coefs[s] * z(seeds[s], tid)[first_block * 256 + i]
 * for i in [0, n): every element gets its additions in seed order, so the bits equal the
 * seed-by-seed loop over the whole tensor. dst may equal src (in place). */
SF_CLONES
void sf_add_dense(float *dst, const float *src, int64_t n, int64_t first_block, uint64_t tid,
                  const uint64_t *seeds, const float *coefs, int64_t k) {
    sf_keys keys[SF_MAX_SEEDS_PER_PASS];
    uint64_t words[4 * SF_TILE_BLOCKS];
    const int64_t tile = (int64_t)SF_TILE_BLOCKS * SF_BLOCK;
    if (k == 0) {
        if (dst != src) memmove(dst, src, (size_t)n * sizeof(float));
        return;
    }
    /* Seeds go in groups whose keys fit on the stack; a later group starts from the earlier
     * group's result, which keeps every element's order of additions. */
    for (int64_t g0 = 0; g0 < k; g0 += SF_MAX_SEEDS_PER_PASS) {
        int64_t gk = k - g0 < SF_MAX_SEEDS_PER_PASS ? k - g0 : SF_MAX_SEEDS_PER_PASS;
        const float *in = g0 == 0 ? src : dst;
        for (int64_t s = 0; s < gk; s++) sf_make_keys(seeds[g0 + s], tid, &keys[s]);
        for (int64_t start = 0; start < n; start += tile) {
            int64_t len = n - start < tile ? n - start : tile;
            int64_t blocks = (len + SF_BLOCK - 1) / SF_BLOCK;
            float *x = dst + start;
            if (x != in + start) memmove(x, in + start, (size_t)len * sizeof(float));
            for (int64_t s = 0; s < gk; s++) {
                u32x8 cbits = sf_splat_bits(coefs[g0 + s]);
                uint64_t base = (uint64_t)(first_block + start / SF_BLOCK);
                for (int64_t b = 0; b < blocks; b++) sf_block(&keys[s], base + (uint64_t)b, words + 4 * b);
                int64_t whole = len / 64;
                for (int64_t w = 0; w < whole; w++) sf_add_word(x + 64 * w, words[w], cbits);
                if (len % 64) sf_add_tail(x + 64 * whole, words + whole, len % 64, coefs[g0 + s]);
            }
        }
    }
}

/* plus = src + c z, minus = src - c z over [0, n) from block first_block: one generation of z
 * for the two probes of a seed (each the bits of sf_add_dense with one seed). */
SF_CLONES
void sf_perturb_pair(const float *src, float *plus, float *minus, int64_t n, int64_t first_block,
                     uint64_t seed, uint64_t tid, float c) {
    sf_keys keys;
    uint64_t words[4];
    const float neg = -c;
    sf_make_keys(seed, tid, &keys);
    int64_t blocks = (n + SF_BLOCK - 1) / SF_BLOCK;
    for (int64_t b = 0; b < blocks; b++) {
        int64_t off = b * SF_BLOCK;
        int64_t len = n - off < SF_BLOCK ? n - off : SF_BLOCK;
        sf_block(&keys, (uint64_t)(first_block + b), words);
        memmove(plus + off, src + off, (size_t)len * sizeof(float));
        memmove(minus + off, src + off, (size_t)len * sizeof(float));
        if (len == SF_BLOCK) {
            u32x8 cp = sf_splat_bits(c), cm = sf_splat_bits(neg);
            for (int w = 0; w < 4; w++) {
                sf_add_word(plus + off + 64 * w, words[w], cp);
                sf_add_word(minus + off + 64 * w, words[w], cm);
            }
        } else {
            sf_add_tail(plus + off, words, len, c);
            sf_add_tail(minus + off, words, len, neg);
        }
    }
}

/* dst = src + c z over [0, n) with z given as its stream words (words[i / 64], bit i % 64): the
 * bits of sf_add_dense with one seed, for a caller that kept the words of a seed to reuse
 * them (the +eps probe, the -eps probe and the update of one ZO step). */
SF_CLONES
void sf_add_words(float *dst, const float *src, int64_t n, const uint64_t *words, float c) {
    u32x8 cbits = sf_splat_bits(c);
    const int64_t tile = (int64_t)SF_TILE_BLOCKS * SF_BLOCK;
    for (int64_t start = 0; start < n; start += tile) {  /* copy and add while in L1 */
        int64_t len = n - start < tile ? n - start : tile;
        float *x = dst + start;
        const uint64_t *wd = words + start / 64;
        if (x != src + start) memmove(x, src + start, (size_t)len * sizeof(float));
        int64_t whole = len / 64;
        for (int64_t w = 0; w < whole; w++) sf_add_word(x + 64 * w, wd[w], cbits);
        if (len % 64) sf_add_tail(x + 64 * whole, wd + whole, len % 64, c);
    }
}

/* The covered elements of a masked tensor: for each seed in order, element j (x[j] when
 * compact, else x[idx[j]]) += coefs[s] * z at stream element idx[j]. Indices are sorted, so
 * consecutive ones share a block, which is generated once per run of them. */
void sf_add_indexed(float *x, const int64_t *idx, int64_t m, int compact, uint64_t tid,
                    const uint64_t *seeds, const float *coefs, int64_t k) {
    uint64_t words[4];
    for (int64_t s = 0; s < k; s++) {
        sf_keys keys;
        uint32_t cb;
        int64_t have = -1;
        sf_make_keys(seeds[s], tid, &keys);
        memcpy(&cb, &coefs[s], sizeof cb);
        for (int64_t j = 0; j < m; j++) {
            int64_t e = idx[j], blk = e / SF_BLOCK, bit = e % SF_BLOCK;
            if (blk != have) {
                sf_block(&keys, (uint64_t)blk, words);
                have = blk;
            }
            uint32_t v = cb ^ ((uint32_t)((words[bit >> 6] >> (bit & 63)) & 1u) << 31);
            float a;
            memcpy(&a, &v, sizeof a);
            x[compact ? j : e] += a;
        }
    }
}

/* ABI version: zkernel.py refuses a library built from another revision of this file. */
int sf_abi_version(void) { return 2; }

/* setuptools builds this file as an extension module and, on some platforms, exports
 * PyInit_<name>; the library is only ever loaded with ctypes, never imported. */
void *PyInit__zkernel(void) { return 0; }
