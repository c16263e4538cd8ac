/* CUDA driver allocations of traced processes (SPEC section 4, cuda alloc tracer).
 *
 * Attached by llmdiag/collectors/cuda_alloc.py as a uprobe + uretprobe pair on
 * each memory entry point that the process's libcuda.so exports, per pid:
 *
 *   cuMemAlloc_v2, cuMemAllocAsync, cuMemCreate   on_<api> saves (out pointer, size)
 *                                                 ret_<api> reads the CUresult and, on
 *                                                 success, the pointer/handle written
 *                                                 to *out; remembers value -> size
 *   cuMemFree_v2, cuMemFreeAsync, cuMemRelease    on_<api> saves the value,
 *                                                 ret_<api> forgets it on success
 *
 * Everything is aggregated in maps and read once per tick; nothing is sent per
 * event. CUresult 2 is CUDA_ERROR_OUT_OF_MEMORY.
 *
 * Defines: MAX_PIDS (traced processes), MAX_LIVE (live allocations remembered),
 *          MAX_INFLIGHT (calls between entry and return, one per thread and api).
 */
#include <uapi/linux/ptrace.h>
#include "common.h"
#include "cuda_alloc.h"

#ifndef MAX_PIDS
#define MAX_PIDS 1024
#endif
#ifndef MAX_LIVE
#define MAX_LIVE 65536
#endif
#ifndef MAX_INFLIGHT
#define MAX_INFLIGHT 16384
#endif

BPF_ARRAY(llmdiag_errors, u64, LLMDIAG_ERR_MAX);
BPF_HASH(inflight, struct cuda_call_key, struct cuda_call, MAX_INFLIGHT);
BPF_HASH(live_allocs, struct cuda_live_key, struct cuda_live, MAX_LIVE);
BPF_HASH(pid_stats, u32, struct cuda_pid_stats, MAX_PIDS);
BPF_HASH(call_results, struct cuda_result_key, u64, MAX_PIDS * 8);
/* Never written: the all-zero initial value of a pid_stats entry (too big for the stack). */
BPF_ARRAY(zero_stats, struct cuda_pid_stats, 1);

static __always_inline void count_error(u32 which)
{
    u64 *slot = llmdiag_errors.lookup(&which);
    if (slot)
        __sync_fetch_and_add(slot, 1);
}

static __always_inline struct cuda_pid_stats *stats_of(u32 tgid)
{
    u32 zero_key = 0;
    struct cuda_pid_stats *zero = zero_stats.lookup(&zero_key);
    if (!zero)
        return 0;
    struct cuda_pid_stats *stats = pid_stats.lookup_or_try_init(&tgid, zero);
    if (!stats)
        count_error(LLMDIAG_ERR_MAP_FULL);
    return stats;
}

static __always_inline void count_result(u32 tgid, u32 api, u32 code)
{
    struct cuda_result_key key = {.tgid = tgid, .api = api, .code = code};
    u64 zero = 0;
    u64 *count = call_results.lookup_or_try_init(&key, &zero);
    if (!count) {
        count_error(LLMDIAG_ERR_MAP_FULL);
        return;
    }
    __sync_fetch_and_add(count, 1);
}

/* Entry of an allocation: arg 1 is where the driver will write the result, arg 2 the size
 * (the same for all three allocation calls). */
static __always_inline int alloc_entry(struct pt_regs *ctx, u32 api)
{
    struct cuda_call_key key = {.tid = (u32)bpf_get_current_pid_tgid(), .api = api};
    struct cuda_call call = {.out_addr = PT_REGS_PARM1(ctx), .size = PT_REGS_PARM2(ctx)};
    if (inflight.update(&key, &call) != 0)
        count_error(LLMDIAG_ERR_MAP_FULL);
    return 0;
}

static __always_inline int alloc_return(struct pt_regs *ctx, u32 api, u32 space)
{
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tgid = pid_tgid >> 32;
    struct cuda_call_key key = {.tid = (u32)pid_tgid, .api = api};
    struct cuda_call *call = inflight.lookup(&key);
    if (!call)
        return 0; /* the call began before the uprobe was attached */
    u64 out_addr = call->out_addr;
    u64 size = call->size;
    inflight.delete(&key);

    u32 code = (u32)PT_REGS_RC(ctx);
    count_result(tgid, api, code);
    struct cuda_pid_stats *stats = stats_of(tgid);
    if (!stats)
        return 0;
    if (code != 0) {
        __sync_fetch_and_add(&stats->alloc_failures, 1);
        __sync_fetch_and_add(&stats->alloc_failed_bytes, size);
        return 0;
    }
    __sync_fetch_and_add(&stats->allocs, 1);
    __sync_fetch_and_add(&stats->alloc_bytes, size);
    u32 slot = size_slot(size) & (CUDA_HIST_SLOTS - 1);
    __sync_fetch_and_add(&stats->size_slots[slot], 1);

    u64 value = 0;
    if (bpf_probe_read_user(&value, sizeof(value), (void *)out_addr) != 0) {
        count_error(LLMDIAG_ERR_READ);
        __sync_fetch_and_add(&stats->allocs_untracked, 1);
        return 0;
    }
    struct cuda_live_key live_key = {.tgid = tgid, .space = space, .value = value};
    /* The same value live twice means its free went by unseen (e.g. cuCtxDestroy
     * freed everything): retire the old size before remembering the new one. */
    struct cuda_live *stale = live_allocs.lookup(&live_key);
    if (stale)
        __sync_fetch_and_add(&stats->outstanding_bytes, -stale->size);
    struct cuda_live live = {.size = size, .api = api};
    if (live_allocs.update(&live_key, &live) != 0) {
        count_error(LLMDIAG_ERR_MAP_FULL);
        __sync_fetch_and_add(&stats->allocs_untracked, 1);
        return 0;
    }
    __sync_fetch_and_add(&stats->outstanding_bytes, size);
    return 0;
}

static __always_inline int free_entry(struct pt_regs *ctx, u32 api)
{
    struct cuda_call_key key = {.tid = (u32)bpf_get_current_pid_tgid(), .api = api};
    struct cuda_call call = {.value = PT_REGS_PARM1(ctx)};
    if (inflight.update(&key, &call) != 0)
        count_error(LLMDIAG_ERR_MAP_FULL);
    return 0;
}

static __always_inline int free_return(struct pt_regs *ctx, u32 api, u32 space)
{
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 tgid = pid_tgid >> 32;
    struct cuda_call_key key = {.tid = (u32)pid_tgid, .api = api};
    struct cuda_call *call = inflight.lookup(&key);
    if (!call)
        return 0;
    u64 value = call->value;
    inflight.delete(&key);

    u32 code = (u32)PT_REGS_RC(ctx);
    count_result(tgid, api, code);
    struct cuda_pid_stats *stats = stats_of(tgid);
    if (!stats)
        return 0;
    if (code != 0) {
        __sync_fetch_and_add(&stats->free_failures, 1);
        return 0;
    }
    __sync_fetch_and_add(&stats->frees, 1);
    struct cuda_live_key live_key = {.tgid = tgid, .space = space, .value = value};
    struct cuda_live *live = live_allocs.lookup(&live_key);
    if (!live) {
        __sync_fetch_and_add(&stats->frees_untracked, 1);
        return 0;
    }
    u64 size = live->size;
    live_allocs.delete(&live_key);
    __sync_fetch_and_add(&stats->freed_bytes, size);
    __sync_fetch_and_add(&stats->outstanding_bytes, -size);
    return 0;
}

int on_mem_alloc(struct pt_regs *ctx) { return alloc_entry(ctx, CUDA_API_MEM_ALLOC); }
int ret_mem_alloc(struct pt_regs *ctx) { return alloc_return(ctx, CUDA_API_MEM_ALLOC, CUDA_SPACE_DEVICE_PTR); }
int on_mem_alloc_async(struct pt_regs *ctx) { return alloc_entry(ctx, CUDA_API_MEM_ALLOC_ASYNC); }
int ret_mem_alloc_async(struct pt_regs *ctx) { return alloc_return(ctx, CUDA_API_MEM_ALLOC_ASYNC, CUDA_SPACE_DEVICE_PTR); }
int on_mem_create(struct pt_regs *ctx) { return alloc_entry(ctx, CUDA_API_MEM_CREATE); }
int ret_mem_create(struct pt_regs *ctx) { return alloc_return(ctx, CUDA_API_MEM_CREATE, CUDA_SPACE_VMM_HANDLE); }

int on_mem_free(struct pt_regs *ctx) { return free_entry(ctx, CUDA_API_MEM_FREE); }
int ret_mem_free(struct pt_regs *ctx) { return free_return(ctx, CUDA_API_MEM_FREE, CUDA_SPACE_DEVICE_PTR); }
int on_mem_free_async(struct pt_regs *ctx) { return free_entry(ctx, CUDA_API_MEM_FREE_ASYNC); }
int ret_mem_free_async(struct pt_regs *ctx) { return free_return(ctx, CUDA_API_MEM_FREE_ASYNC, CUDA_SPACE_DEVICE_PTR); }
int on_mem_release(struct pt_regs *ctx) { return free_entry(ctx, CUDA_API_MEM_RELEASE); }
int ret_mem_release(struct pt_regs *ctx) { return free_return(ctx, CUDA_API_MEM_RELEASE, CUDA_SPACE_VMM_HANDLE); }
