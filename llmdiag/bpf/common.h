/* Shared by every llmdiag BPF program.
 *
 * Each program declares, in its own .bpf.c file (bcc rewrites map calls only
 * in the main file and refuses them inside macros, so they cannot live here):
 *
 *   BPF_ARRAY(llmdiag_errors, u64, LLMDIAG_ERR_MAX);
 *
 * and increments llmdiag_errors[LLMDIAG_ERR_*] when an operation fails.
 * llmdiag.bpf.loader.Program.errors() reads it; collectors surface it as
 * metrics (bpf_map_full_total, ...).
 */
#ifndef LLMDIAG_COMMON_H
#define LLMDIAG_COMMON_H

enum llmdiag_error {
    LLMDIAG_ERR_MAP_FULL = 0, /* a map update/insert failed (map full or -ENOMEM) */
    LLMDIAG_ERR_READ = 1,     /* a bpf_probe_read_* failed */
    LLMDIAG_ERR_MAX = 4,
};

#endif /* LLMDIAG_COMMON_H */
