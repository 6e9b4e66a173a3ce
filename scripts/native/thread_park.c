/* Park a busy-spinning native thread of this process while it is not needed.
 *
 * Mooncake PG's worker thread polls its task table in an endless loop
 * (mooncake-pg/src/mooncake_worker_thread.cpp: `while (running_) { PAUSE(); ... }`),
 * one core per process even when no collective is in flight. The CPU engine parks it
 * while a scheduler idles and through each forward pass: eep_park() sends the thread a
 * real-time signal whose handler sleeps on a futex until eep_unpark(). Only
 * async-signal-safe calls run in the handler. A park also ends by itself after
 * max_park_ns: if a collective ever started while the worker was parked, it would be
 * delayed by that much, never hung.
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <signal.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static volatile int park_requested = 0;
static volatile int parked_count = 0;
static int park_signal = 0;
static long max_park_ns = 50 * 1000 * 1000;

static long futex(volatile int *addr, int op, int val, const struct timespec *timeout) {
    return syscall(SYS_futex, addr, op, val, timeout, NULL, 0);
}

static long elapsed_ns(const struct timespec *since) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - since->tv_sec) * 1000000000L + (now.tv_nsec - since->tv_nsec);
}

static void park_handler(int sig) {
    (void)sig;
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    __atomic_add_fetch(&parked_count, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&park_requested, __ATOMIC_SEQ_CST)) {
        long left = max_park_ns - elapsed_ns(&start);
        if (left <= 0) break;
        struct timespec timeout = {left / 1000000000L, left % 1000000000L};
        futex(&park_requested, FUTEX_WAIT_PRIVATE, 1, &timeout);
    }
    __atomic_sub_fetch(&parked_count, 1, __ATOMIC_SEQ_CST);
}

/* Installs the handler for `sig` (a real-time signal); a park lasts at most `max_park_us`.
 * Returns 0 or -1 (errno set). */
int eep_park_install(int sig, long max_park_us) {
    if (max_park_us <= 0) return -1;
    max_park_ns = max_park_us * 1000L;
    struct sigaction action;
    memset(&action, 0, sizeof(action));
    action.sa_handler = park_handler;
    action.sa_flags = SA_RESTART;
    sigemptyset(&action.sa_mask);
    if (sigaction(sig, &action, NULL) != 0) return -1;
    park_signal = sig;
    return 0;
}

/* Asks thread `tid` of this process to park. Returns 0 or -1 (errno set). */
int eep_park(int tid) {
    __atomic_store_n(&park_requested, 1, __ATOMIC_SEQ_CST);
    return (int)syscall(SYS_tgkill, getpid(), tid, park_signal);
}

/* Releases every parked thread. */
void eep_unpark(void) {
    __atomic_store_n(&park_requested, 0, __ATOMIC_SEQ_CST);
    futex(&park_requested, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL);
}

/* How many threads are in the handler right now (tests and diagnostics). */
int eep_parked_count(void) { return __atomic_load_n(&parked_count, __ATOMIC_SEQ_CST); }
