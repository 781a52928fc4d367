/* A Gemma 4 engine in C, as small as it can be: the first nodes of layer 0 (embed, input_layernorm, q_proj,
 * q_norm, q_rope) on a checkpoint's safetensors, written as a trace file (docs/trace-file.md) for
 *
 *     gemma4-conformance judge trace.safetensors --weights CHECKPOINT
 *
 * Build:  cc -O2 -std=c99 -o trace_engine trace_engine.c -lm
 *         cc ... -DROPE_ADJACENT_PAIRS     a planted bug: RoPE rotates adjacent pairs (2i, 2i+1), the
 *                                          GPT-J layout, instead of Gemma's rotate-half pairs (i, i + D/2)
 * Run:    trace_engine OUT PREFIX EPS THETA TOKENS SHARD...
 *         PREFIX: the tensors' stored prefix ("model.language_model." in the hub's layout); EPS, THETA: the
 *         config's rms_norm_eps and layer 0's rope_theta; TOKENS: comma-separated ids; SHARD: the
 *         checkpoint's safetensors files (each tensor is looked up in all of them).
 *
 * Each node is computed in double from the previous node's float32 output (what the trace holds and the
 * judge replays) and stored as float32: the trace declares dtype float32.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void die(const char *what, const char *detail) {
    fprintf(stderr, "trace_engine: %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
    exit(2);
}

/* The tensor `name` of the first shard that holds it, converted to float; its element count in *count.
 * A safetensors file is an 8-byte little-endian header length, a JSON header and the raw bytes; the
 * header's entry for a name is {"dtype":...,"shape":[...],"data_offsets":[begin,end]}. */
static float *load(char **shards, int nshards, const char *name, size_t *count) {
    char key[512];
    snprintf(key, sizeof key, "\"%s\"", name);
    for (int s = 0; s < nshards; s++) {
        FILE *f = fopen(shards[s], "rb");
        if (!f) die("cannot open", shards[s]);
        unsigned char len[8];
        if (fread(len, 1, 8, f) != 8) die("truncated safetensors file", shards[s]);
        uint64_t n = 0;
        for (int i = 7; i >= 0; i--) n = n << 8 | len[i];
        char *header = malloc(n + 1);
        if (!header || fread(header, 1, n, f) != n) die("truncated safetensors header", shards[s]);
        header[n] = 0;
        char *entry = strstr(header, key);
        if (!entry) { free(header); fclose(f); continue; }
        char *end = strchr(entry, '}');
        char *dtype = strstr(entry, "\"dtype\"");
        char *offsets = strstr(entry, "\"data_offsets\"");
        if (!end || !dtype || !offsets || dtype > end || offsets > end) die("corrupt header entry", name);
        unsigned long long begin, stop;
        if (sscanf(strchr(offsets, '[') + 1, "%llu , %llu", &begin, &stop) != 2) die("corrupt data_offsets", name);
        const char *value = strchr(dtype + strlen("\"dtype\""), '"');  /* the value's opening quote */
        int bf16 = value && !strncmp(value, "\"BF16\"", 6), f32 = value && !strncmp(value, "\"F32\"", 5);
        if (!bf16 && !f32) die("only BF16 and F32 tensors are read", name);
        size_t size = bf16 ? 2 : 4, nbytes = stop - begin;
        *count = nbytes / size;
        unsigned char *raw = malloc(nbytes ? nbytes : 1);
        float *out = malloc((*count ? *count : 1) * sizeof(float));
        if (fseek(f, (long)(8 + n + begin), SEEK_SET) || fread(raw, 1, nbytes, f) != nbytes)
            die("truncated data", name);
        for (size_t i = 0; i < *count; i++) {
            uint32_t bits = bf16 ? (uint32_t)(raw[2 * i] | raw[2 * i + 1] << 8) << 16
                                 : (uint32_t)raw[4 * i] | (uint32_t)raw[4 * i + 1] << 8 | (uint32_t)raw[4 * i + 2] << 16
                                       | (uint32_t)raw[4 * i + 3] << 24;
            memcpy(&out[i], &bits, 4);
        }
        free(raw); free(header); fclose(f);
        return out;
    }
    die("no shard holds", name);
    return NULL;
}

/* rmsnorm over the last axis of rows x n: x / sqrt(mean(x^2) + eps) * w */
static void rmsnorm(const float *x, const float *w, float *out, size_t rows, size_t n, double eps) {
    for (size_t r = 0; r < rows; r++) {
        double squares = 0;
        for (size_t i = 0; i < n; i++) squares += (double)x[r * n + i] * x[r * n + i];
        double scale = 1.0 / sqrt(squares / n + eps);
        for (size_t i = 0; i < n; i++) out[r * n + i] = (float)(x[r * n + i] * scale * w[i]);
    }
}

/* The two coordinates of head row x that RoPE rotates together as pair i, and the pair's frequency index. */
static void pair(size_t i, size_t D, size_t *a, size_t *b) {
#ifdef ROPE_ADJACENT_PAIRS
    (void)D;
    *a = 2 * i, *b = 2 * i + 1;
#else
    *a = i, *b = i + D / 2;
#endif
}

struct tensor { const char *name, *dtype; int ndim; size_t shape[3]; const void *data; size_t nbytes; };

static void write_trace(const char *path, const char *metadata, struct tensor *t, int n) {
    char header[8192];
    size_t used = (size_t)snprintf(header, sizeof header, "{\"__metadata__\":%s", metadata), offset = 0;
    for (int i = 0; i < n; i++) {
        used += (size_t)snprintf(header + used, sizeof header - used, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[",
                                 t[i].name, t[i].dtype);
        for (int d = 0; d < t[i].ndim; d++)
            used += (size_t)snprintf(header + used, sizeof header - used, "%s%zu", d ? "," : "", t[i].shape[d]);
        used += (size_t)snprintf(header + used, sizeof header - used, "],\"data_offsets\":[%zu,%zu]}", offset,
                                 offset + t[i].nbytes);
        offset += t[i].nbytes;
    }
    used += (size_t)snprintf(header + used, sizeof header - used, "}");
    while (used % 8) header[used++] = ' ';  /* the data starts 8-byte aligned, as the format recommends */
    if (used >= sizeof header) die("header too long", path);
    FILE *f = fopen(path, "wb");
    if (!f) die("cannot write", path);
    unsigned char len[8];
    for (int i = 0; i < 8; i++) len[i] = (unsigned char)((uint64_t)used >> (8 * i));
    fwrite(len, 1, 8, f);
    fwrite(header, 1, used, f);
    for (int i = 0; i < n; i++) fwrite(t[i].data, 1, t[i].nbytes, f);  /* little-endian, as on x86 and ARM */
    if (fclose(f)) die("cannot write", path);
}

int main(int argc, char **argv) {
    if (argc < 7) die("usage: trace_engine OUT PREFIX EPS THETA TOKENS SHARD...", NULL);
    const char *out = argv[1], *prefix = argv[2];
    double eps = atof(argv[3]), theta = atof(argv[4]);
    char **shards = argv + 6;
    int nshards = argc - 6;
    int64_t tokens[4096];
    size_t T = 0;
    for (char *p = argv[5]; *p && T < 4096; T++) {
        tokens[T] = strtoll(p, &p, 10);
        if (*p == ',') p++;
    }
    char name[512];
    size_t nE, H, nq, D;
    snprintf(name, sizeof name, "%sembed_tokens.weight", prefix);
    float *E = load(shards, nshards, name, &nE);
    snprintf(name, sizeof name, "%slayers.0.input_layernorm.weight", prefix);
    float *w_in = load(shards, nshards, name, &H);
    snprintf(name, sizeof name, "%slayers.0.self_attn.q_proj.weight", prefix);
    float *Wq = load(shards, nshards, name, &nq);
    snprintf(name, sizeof name, "%slayers.0.self_attn.q_norm.weight", prefix);
    float *w_q = load(shards, nshards, name, &D);
    size_t Q = nq / H, heads = Q / D;

    float *embed = malloc(T * H * 4), *h = malloc(T * H * 4), *q = malloc(T * Q * 4), *qn = malloc(T * Q * 4),
          *qr = malloc(T * Q * 4);
    for (size_t t = 0; t < T; t++) {
        if (tokens[t] < 0 || (size_t)tokens[t] >= nE / H) die("a token id is outside the vocabulary", argv[5]);
        for (size_t i = 0; i < H; i++) embed[t * H + i] = (float)(sqrt((double)H) * E[tokens[t] * H + i]);
    }
    rmsnorm(embed, w_in, h, T, H, eps);
    for (size_t t = 0; t < T; t++)
        for (size_t j = 0; j < Q; j++) {
            double sum = 0;
            for (size_t i = 0; i < H; i++) sum += (double)Wq[j * H + i] * h[t * H + i];
            q[t * Q + j] = (float)sum;
        }
    rmsnorm(q, w_q, qn, T * heads, D, eps);
    for (size_t t = 0; t < T; t++)
        for (size_t k = 0; k < heads; k++) {
            const float *x = qn + (t * heads + k) * D;
            float *y = qr + (t * heads + k) * D;
            for (size_t i = 0; i < D / 2; i++) {
                double angle = (double)t * pow(theta, -2.0 * (double)i / (double)D), c = cos(angle), s = sin(angle);
                size_t a, b;
                pair(i, D, &a, &b);
                y[a] = (float)(x[a] * c - x[b] * s);
                y[b] = (float)(x[b] * c + x[a] * s);
            }
        }

    int64_t *positions = malloc(T * 8);
    for (size_t t = 0; t < T; t++) positions[t] = (int64_t)t;
    char metadata[1024];
    snprintf(metadata, sizeof metadata, "{\"format\":\"gemma4-conformance-trace\",\"format_version\":\"1\","
             "\"engine\":\"c-example%s\",\"engine_version\":\"1\",\"dtype\":\"float32\",\"device\":\"cpu\","
             "\"checkpoint\":\"%s\"}",
#ifdef ROPE_ADJACENT_PAIRS
             "-adjacent-pairs",
#else
             "",
#endif
             shards[0]);
    struct tensor t[] = {
        {"tokens", "I64", 1, {T}, tokens, T * 8},
        {"positions", "I64", 1, {T}, positions, T * 8},
        {"embed", "F32", 2, {T, H}, embed, T * H * 4},
        {"layers.0.input_layernorm", "F32", 2, {T, H}, h, T * H * 4},
        {"layers.0.q_proj", "F32", 2, {T, Q}, q, T * Q * 4},
        {"layers.0.q_norm", "F32", 3, {T, heads, D}, qn, T * Q * 4},
        {"layers.0.q_rope", "F32", 3, {T, heads, D}, qr, T * Q * 4},
    };
    write_trace(out, metadata, t, (int)(sizeof t / sizeof t[0]));
    return 0;
}
