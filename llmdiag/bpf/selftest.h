/* selftest.bpf.c: counts TCP state transitions of one port, keyed by
 * transition_key(oldstate, newstate). The loader's own test loads it. */
#ifndef LLMDIAG_SELFTEST_H
#define LLMDIAG_SELFTEST_H

static __always_inline u32 transition_key(int oldstate, int newstate)
{
    return ((u32)oldstate << 8) | (u32)newstate;
}

#endif
