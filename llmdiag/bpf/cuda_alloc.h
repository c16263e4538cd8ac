/* cuda_alloc.bpf.c: CUDA driver allocations of traced processes, counted in
 * maps (no per-event output). The only definition of the structs the Python
 * side (llmdiag/collectors/cuda_alloc.py) reads; keep the two in step.
 *
 * Everything here is plain C with no bcc macros, so a unit test can compile
 * it with gcc and check size_slot() against the Python bucket bounds.
 */
#ifndef LLMDIAG_CUDA_ALLOC_H
#define LLMDIAG_CUDA_ALLOC_H

#define CUDA_HIST_SLOTS 64

/* Which driver entry point a call went through (the api label). */
enum cuda_api {
    CUDA_API_MEM_ALLOC = 0,       /* cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) */
    CUDA_API_MEM_ALLOC_ASYNC = 1, /* cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream) */
    CUDA_API_MEM_CREATE = 2,      /* cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, prop, flags) */
    CUDA_API_MEM_FREE = 3,        /* cuMemFree_v2(CUdeviceptr) */
    CUDA_API_MEM_FREE_ASYNC = 4,  /* cuMemFreeAsync(CUdeviceptr, CUstream) */
    CUDA_API_MEM_RELEASE = 5,     /* cuMemRelease(CUmemGenericAllocationHandle) */
    CUDA_API_MAX = 6,
};

/* Device pointers and VMM handles are different namespaces that may hold the
 * same number: the live-allocation key says which one it is. */
enum cuda_space {
    CUDA_SPACE_DEVICE_PTR = 0,
    CUDA_SPACE_VMM_HANDLE = 1,
};

/* An allocation or free between its uprobe and its uretprobe, keyed by thread
 * and api (an api may call another one internally on the same thread). */
struct cuda_call_key {
    u32 tid;
    u32 api;
};

struct cuda_call {
    u64 out_addr; /* alloc: user address of the CUdeviceptr / handle the driver fills in */
    u64 size;     /* alloc: requested bytes */
    u64 value;    /* free: the pointer or handle being freed */
};

/* One live allocation this tracer saw succeed. */
struct cuda_live_key {
    u32 tgid;
    u32 space;
    u64 value;
};

struct cuda_live {
    u64 size;
    u32 api;
    u32 pad;
};

/* Per traced process (tgid); every field only grows except outstanding_bytes. */
struct cuda_pid_stats {
    u64 allocs;              /* successful allocations, all apis */
    u64 alloc_bytes;         /* bytes of those */
    u64 alloc_failures;      /* allocations that returned an error */
    u64 alloc_failed_bytes;  /* bytes those asked for */
    u64 frees;               /* successful frees/releases */
    u64 freed_bytes;         /* bytes of the frees whose allocation was seen */
    u64 frees_untracked;     /* successful frees of memory allocated before tracing began */
    u64 free_failures;       /* frees that returned an error */
    u64 allocs_untracked;    /* successful allocations the live map had no room for */
    u64 outstanding_bytes;   /* two's complement: allocated - freed, of tracked allocations */
    u64 size_slots[CUDA_HIST_SLOTS]; /* successful allocations by size_slot(size) */
};

/* Count of calls per (tgid, api, CUresult). */
struct cuda_result_key {
    u32 tgid;
    u32 api;
    u32 code;
    u32 pad;
};

/* Histogram slot of an allocation size: the smallest i with size <= 2^i,
 * capped at CUDA_HIST_SLOTS - 1. Slot i is the Prometheus bucket le=2^i.
 * (bits needed to represent size - 1, computed without loops.) */
static inline __attribute__((always_inline)) u32 size_slot(u64 size)
{
    u64 v = size > 0 ? size - 1 : 0;
    u32 bits = 0;
    if (v >> 32) { v >>= 32; bits += 32; }
    if (v >> 16) { v >>= 16; bits += 16; }
    if (v >> 8) { v >>= 8; bits += 8; }
    if (v >> 4) { v >>= 4; bits += 4; }
    if (v >> 2) { v >>= 2; bits += 2; }
    if (v >> 1) { v >>= 1; bits += 1; }
    bits += (u32)v;
    return bits < CUDA_HIST_SLOTS ? bits : CUDA_HIST_SLOTS - 1;
}

#endif /* LLMDIAG_CUDA_ALLOC_H */
