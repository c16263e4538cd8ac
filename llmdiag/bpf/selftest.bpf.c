/* Loader self-test: count TCP state transitions touching SELFTEST_PORT.
 *
 * Defines: SELFTEST_PORT (host byte order; 0 counts every TCP socket),
 *          MAX_TRANSITIONS (size of the transitions map).
 */
#include <uapi/linux/in.h>
#include "common.h"
#include "selftest.h"

#ifndef SELFTEST_PORT
#define SELFTEST_PORT 0
#endif
#ifndef MAX_TRANSITIONS
#define MAX_TRANSITIONS 256
#endif

BPF_ARRAY(llmdiag_errors, u64, LLMDIAG_ERR_MAX);
BPF_HASH(transitions, u32, u64, MAX_TRANSITIONS);

static __always_inline void count_error(u32 which)
{
    u64 *slot = llmdiag_errors.lookup(&which);
    if (slot)
        __sync_fetch_and_add(slot, 1);
}

TRACEPOINT_PROBE(sock, inet_sock_set_state)
{
    if (args->protocol != IPPROTO_TCP)
        return 0;
    if (SELFTEST_PORT != 0 && args->sport != SELFTEST_PORT && args->dport != SELFTEST_PORT)
        return 0;
    u32 key = transition_key(args->oldstate, args->newstate);
    u64 zero = 0;
    u64 *count = transitions.lookup_or_try_init(&key, &zero);
    if (!count) {
        count_error(LLMDIAG_ERR_MAP_FULL);
        return 0;
    }
    __sync_fetch_and_add(count, 1);
    return 0;
}
