/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * runtime.c -- thread control, shared by the Python and the C front ends.
 */
#include "rx_internal.h"

#ifdef _OPENMP
static int rx_default_threads;   /* omp_get_max_threads() before any override */

void rx_set_num_threads(int n) {
    if (!rx_default_threads) rx_default_threads = omp_get_max_threads();
    omp_set_num_threads(n >= 1 ? n : rx_default_threads);
}
int rx_get_num_threads(void) { return omp_get_max_threads(); }
int rx_has_openmp(void) { return 1; }
#else
void rx_set_num_threads(int n) { (void)n; }
int rx_get_num_threads(void) { return 1; }
int rx_has_openmp(void) { return 0; }
#endif
