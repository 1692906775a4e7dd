/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * check.h -- the C test programs' one assertion: CHECK(cond, fmt, ...)
 * prints "FAIL file:line: message" to stderr and counts the failure in
 * `failures` (each program returns nonzero when it is), so one program
 * reports every failing check, not only the first. Each test program is
 * one translation unit, so the counter is its own.
 */
#ifndef RX_TEST_CHECK_H
#define RX_TEST_CHECK_H

#include <stdio.h>

static int failures;

#define CHECK(cond, ...)                                         \
    do {                                                         \
        if (!(cond)) {                                           \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                        \
            fprintf(stderr, "\n");                               \
            failures++;                                          \
        }                                                        \
    } while (0)

#endif
