// Slot loads as copy programs (lists of copies and zero fills) and the pass gate the copy thread
// waits on, for ThreadCopyEngine (device.py) via kernels/copy.py.
#define _GNU_SOURCE  // sched_getcpu, CPU_SET
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernels.h"

// A slot load as a list of pieces (CopyOp, kernels.h), run in one call so the copy thread holds the
// GIL only to set it up: copies of host tensors already in the slots' form
// (`LoRAMemoryPool.host_form`) and zero fills (ranks and modules the adapter lacks).

static void run_copy_op(const CopyOp *op) {
    if (op->src)
        memcpy(op->dst, op->src, (size_t)op->nbytes);
    else
        memset(op->dst, 0, (size_t)op->nbytes);
}

// Every piece at once (a blocking load).
void run_copy_program(const CopyOp *ops, int64_t n) {
    for (int64_t k = 0; k < n; k++) run_copy_op(&ops[k]);
}

// The pass gate (PassGate, kernels.h) is shared by ThreadCopyEngine and this copy thread.

// Sleeps until the pass ends or `timeout_ns` passes, whichever is first. A futex: the thread is
// woken by the end of the pass itself, in microseconds, with no GIL to take.
static void wait_for_gap(PassGate *gate, int64_t timeout_ns) {
#ifdef __linux__
    struct timespec ts = {timeout_ns / 1000000000, timeout_ns % 1000000000};
    syscall(SYS_futex, &gate->hold, FUTEX_WAIT_PRIVATE, 1, &ts, NULL, 0);
#else
    struct timespec ts = {0, timeout_ns < 50000 ? timeout_ns : 50000};
    int64_t left = timeout_ns;
    while (left > 0 && __atomic_load_n(&gate->hold, __ATOMIC_ACQUIRE)) {
        nanosleep(&ts, NULL);
        left -= ts.tv_nsec;
    }
#endif
}

#ifdef __linux__
// The copy thread may run on any of its cores but the scheduler thread's, if that leaves one: put
// where the scheduler thread woke it, the two took turns and the gap between passes stretched.
static void keep_off_cpu(int cpu, int *avoided, const cpu_set_t *allowed) {
    if (cpu < 0 || cpu == *avoided || !CPU_ISSET(cpu, allowed) || CPU_COUNT(allowed) < 2) return;
    cpu_set_t set = *allowed;
    CPU_CLR(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) == 0) *avoided = cpu;
}
#define KEEP_OFF_SETUP                                                                                    \
    cpu_set_t allowed;                                                                                    \
    int avoided = -1;                                                                                     \
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) CPU_ZERO(&allowed);
#define KEEP_OFF(gate) keep_off_cpu(__atomic_load_n(&(gate)->scheduler_cpu, __ATOMIC_RELAXED), &avoided, &allowed)
#define KEEP_OFF_UNDO \
    if (avoided >= 0) sched_setaffinity(0, sizeof allowed, &allowed);
#define CURRENT_CPU() sched_getcpu()
#else
#define KEEP_OFF_SETUP
#define KEEP_OFF(gate)
#define KEEP_OFF_UNDO
#define CURRENT_CPU() (-1)
#endif

// A whole slot load on the copy thread, in one call without the GIL: between forward passes as
// many pieces as fit in the gap (the next pass stops it before its next piece); during a pass one
// piece each `piece_interval_ns`, so a load still finishes when the gaps are short.
void run_copy_program_gated(const CopyOp *ops, int64_t n, PassGate *gate, int64_t piece_interval_ns) {
    KEEP_OFF_SETUP
    int64_t k = 0;
    while (k < n) {
        int in_pass = __atomic_load_n(&gate->hold, __ATOMIC_ACQUIRE);
        if (in_pass) {
            wait_for_gap(gate, piece_interval_ns);
            in_pass = __atomic_load_n(&gate->hold, __ATOMIC_ACQUIRE);
        }
        KEEP_OFF(gate);
        if (in_pass) {
            run_copy_op(&ops[k++]);
            continue;
        }
        while (k < n && !__atomic_load_n(&gate->hold, __ATOMIC_ACQUIRE)) run_copy_op(&ops[k++]);
    }
    KEEP_OFF_UNDO
}

// On the scheduler thread when a forward pass ends (it sets `hold` itself when one starts).
void pass_gate_open(PassGate *gate) {
    __atomic_store_n(&gate->scheduler_cpu, CURRENT_CPU(), __ATOMIC_RELAXED);
    __atomic_store_n(&gate->hold, 0, __ATOMIC_RELEASE);
#ifdef __linux__
    syscall(SYS_futex, &gate->hold, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
#endif
}
