/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * train_step.c -- one forward and backward of a small RWKV-X model through
 * the C API of rwkvx_c, linked against the library the Python package
 * installs. Prints the loss and the global grad norm with full precision.
 * Every call that can fail returns an RX_* code; rx_last_error() says why.
 *
 * Build and run (the package must be installed or built in place):
 *
 *   INC=$(python3 -c 'import rwkvx_c; print(rwkvx_c.get_include())')
 *   LIB=$(python3 -c 'import rwkvx_c; print(rwkvx_c.get_library_dir())')
 *   cc -O2 examples/train_step.c -I"$INC" -L"$LIB" -lrwkvx_c -Wl,-rpath,"$LIB" -lm \
 *      -o train_step
 *   ./train_step [seed [T]]          # defaults: seed 0, T 16
 *
 * The same step in Python (tests/test_c_example.py checks they agree):
 *   m = rwkvx_c.RxPtModel(config, seed)        # config as below
 *   m.forward(tokens); loss = m.backward(targets, ignore_index=0)
 * with tokens and targets from make_batch.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "rx_pretrain.h"

/* tokens[t] = (7t + 3) mod vocab; targets[t] = tokens[t+1], the last one
 * set to ignore_index so it drops out of the mean */
static void make_batch(int T, int vocab, int ignore_index, int *tokens, int *targets) {
    for (int t = 0; t < T; t++) tokens[t] = (int)((7LL * t + 3) % vocab);
    for (int t = 0; t < T; t++) targets[t] = t + 1 < T ? tokens[t + 1] : ignore_index;
}

int main(int argc, char **argv) {
    uint64_t seed = argc > 1 ? strtoull(argv[1], NULL, 0) : 0;
    int T = argc > 2 ? atoi(argv[2]) : 16;
    if (T < 1) {
        fprintf(stderr, "T must be >= 1\n");
        return 2;
    }
    rx_pt_config cfg = {
        .n_embd = 32, .n_head = 2, .head_size = 16,
        .n_rwkv_layer = 3, .n_attn_layer = 1, .vocab_size = 50,
        .Dw = 8, .Da = 8, .Dg = 8, .Dv = 4, .ffn_dim = 64,
        .chunk_size = 4, .moba_top_k = 1,
    };
    const int ignore_index = 0;
    rx_ptmodel *m = NULL;
    rx_pt_acts *acts = NULL;
    int *tokens = malloc((size_t)T * sizeof(int)), *targets = malloc((size_t)T * sizeof(int));
    if (!tokens || !targets) {
        fprintf(stderr, "allocation failed\n");
        return 1;
    }
    make_batch(T, cfg.vocab_size, ignore_index, tokens, targets);

    double loss;
    int rc = rx_model_create(&cfg, 0, seed, &m);
    if (rc == RX_OK) rc = rx_pt_acts_create(m, 1, T, &acts);
    if (rc == RX_OK) rc = rx_pretrain_forward(m, tokens, T, acts);
    if (rc == RX_OK) rc = rx_pretrain_backward_loss(m, acts, targets, 1, T, ignore_index, &loss);
    if (rc != RX_OK) {
        fprintf(stderr, "%s (%s)\n", rx_last_error(), rx_strerror(rc));
        return 1;
    }
    int64_t n;
    const float *g = rx_ptmodel_grad_arena(m, &n);
    double sq = 0.0;
    for (int64_t i = 0; i < n; i++) sq += (double)g[i] * g[i];
    printf("layers %s\nparams %lld\nloss %.17g\ngrad_norm %.17g\n", rx_ptmodel_layers(m),
           (long long)n, loss, sqrt(sq));

    free(tokens);
    free(targets);
    rx_pt_acts_free(acts);
    rx_ptmodel_free(m);
    return 0;
}
