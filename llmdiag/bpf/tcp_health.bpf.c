/* TCP health per backend listen port (server side) and per remote ip:port
 * (client side), aggregated in maps that user space reads once per tick.
 * Nothing here sends per-event data to user space.
 *
 * Attribution: the ports map holds the ports of interest, so every event on
 * other traffic costs one or two hash lookups. Events that carry addresses and
 * ports (inet_sock_set_state, tcp_retransmit_skb, tcp_send_reset,
 * tcp_receive_reset, tcp_probe) are classified from their arguments. Sends
 * (sock:sock_send_length) carry only the socket pointer, so a socks map
 * (sk -> endpoint) is filled on state changes; sockets opened before the
 * program was loaded are classified on their first send from the head of
 * struct sock_common (addresses, ports, family, skc_prot: a stable layout),
 * and every state change cross-checks that read against the tracepoint
 * (G_SOCK_COMMON_MISMATCH must stay 0).
 *
 * Defines (set by llmdiag/collectors/tcp.py through the loader):
 *   SEND_PATH          3 = raw tracepoint sock_send_length, 1 = the same as a perf tracepoint,
 *                      2 = kprobe tcp_sendmsg (+kretprobe), 0 = none
 *   SEND_TIMING        1 = time send syscalls of the pids in timed_pids (blocking senders)
 *   SEND_BLOCK_NS      a timed send at least this long counts as send_blocked
 *   SRTT_SAMPLE_MASK   tcp_probe is sampled 1 in (mask + 1) events
 *   HAVE_RETRANSMIT, HAVE_SEND_RESET, HAVE_RECEIVE_RESET, HAVE_TCP_PROBE, HAVE_EXCEED_BUF
 *                      1 where the kernel has that tracepoint (feature probe)
 *   DECLARE_SK_RST_REASON  1 when the kernel headers lack enum sk_rst_reason (< 6.10)
 *   MAX_PORTS, MAX_SOCKS, MAX_ENDPOINTS, MAX_HIST, MAX_PIDS   map sizes
 */
#include <uapi/linux/in.h>
#include <uapi/linux/errno.h>
#include "common.h"
#include "tcp_health.h"

#ifndef SEND_PATH
#define SEND_PATH 1
#endif
#ifndef SEND_TIMING
#define SEND_TIMING 0
#endif
#ifndef SEND_BLOCK_NS
#define SEND_BLOCK_NS 1000000
#endif
#ifndef SRTT_SAMPLE_MASK
#define SRTT_SAMPLE_MASK 0
#endif
#ifndef HAVE_RETRANSMIT
#define HAVE_RETRANSMIT 1
#endif
#ifndef HAVE_SEND_RESET
#define HAVE_SEND_RESET 1
#endif
#ifndef HAVE_RECEIVE_RESET
#define HAVE_RECEIVE_RESET 1
#endif
#ifndef HAVE_TCP_PROBE
#define HAVE_TCP_PROBE 1
#endif
#ifndef HAVE_EXCEED_BUF
#define HAVE_EXCEED_BUF 1
#endif
#ifndef DECLARE_SK_RST_REASON
#define DECLARE_SK_RST_REASON 0
#endif
#ifndef MAX_PORTS
#define MAX_PORTS 1024
#endif
#ifndef MAX_SOCKS
#define MAX_SOCKS 65536
#endif
#ifndef MAX_ENDPOINTS
#define MAX_ENDPOINTS 4096
#endif
#ifndef MAX_HIST
#define MAX_HIST 16384
#endif
#ifndef MAX_PIDS
#define MAX_PIDS 1024
#endif
#ifndef MAX_OWN
#define MAX_OWN 4096
#endif

#define FAMILY_INET 2
#define FAMILY_INET6 10

/* include/net/tcp_states.h */
#define TCP_ESTABLISHED 1
#define TCP_SYN_SENT 2
#define TCP_FIN_WAIT2 5
#define TCP_CLOSE 7
#define TCP_CLOSE_WAIT 8
#define TCP_CLOSING 11

BPF_ARRAY(llmdiag_errors, u64, LLMDIAG_ERR_MAX);
BPF_ARRAY(globals, u64, G_MAX);
BPF_HASH(ports, u16, u8, MAX_PORTS);                           /* port -> enum port_role bits */
BPF_TABLE("lru_hash", u64, struct endpoint_key, socks, MAX_SOCKS); /* sk -> endpoint */
BPF_HASH(stats, struct endpoint_key, struct tcp_stats, MAX_ENDPOINTS);
BPF_HASH(connect_hist, struct hist_key, u64, MAX_HIST);
BPF_TABLE("lru_hash", u64, u64, connect_start, MAX_SOCKS);     /* sk -> SYN_SENT ts */
BPF_HASH(timed_pids, u32, u8, MAX_PIDS);                        /* tgid -> 1 */
/* llmdiag's own connections (its scrapes), key (local port << 16) | remote port, set from
 * user space before each connect: never counted against a backend. */
BPF_HASH(own_conns, u32, u8, MAX_OWN);
BPF_TABLE("lru_hash", u32, u64, send_start, 16384);            /* tid -> send syscall entry ts */

/* The head of struct sock_common (include/net/sock.h) up to skc_v6_rcv_saddr.
 * This layout has been stable for many releases (checked against the running
 * 6.18 kernel's BTF and the 6.1 headers), unlike the rest of struct sock, which
 * the 6.1 headers bcc compiles with here may get wrong. inet_sock_set_state
 * cross-checks it against the tracepoint on every state change of a watched
 * socket (G_SOCK_COMMON_MISMATCH). */
struct sock_common_head {
    __be32 daddr;           /* 0  skc_daddr */
    __be32 rcv_saddr;       /* 4  skc_rcv_saddr */
    __u32 hash;             /* 8  skc_hash */
    __be16 dport;           /* 12 skc_dport */
    __u16 num;              /* 14 skc_num: local port, host order */
    __u16 family;           /* 16 skc_family */
    __u8 state;             /* 18 skc_state */
    __u8 flags;             /* 19 skc_reuse... bitfield */
    __s32 bound_dev_if;     /* 20 */
    __u64 bind_node[2];     /* 24 skc_bind_node */
    __u64 prot;             /* 40 skc_prot: &tcp_prot / &tcpv6_prot for TCP */
    __u64 net;              /* 48 skc_net */
    __u8 v6_daddr[16];      /* 56 skc_v6_daddr */
    __u8 v6_rcv_saddr[16];  /* 72 skc_v6_rcv_saddr */
};

/* skc_prot of TCP sockets, learned from inet_sock_set_state (whose protocol
 * argument says TCP): [0] IPv4 (&tcp_prot), [1] IPv6 (&tcpv6_prot). The raw
 * sock_send_length tracepoint has no protocol argument; comparing skc_prot
 * with these tells TCP sockets from UDP ones on the same port. */
BPF_ARRAY(tcp_prots, u64, 2);

static __always_inline void count_error(u32 which)
{
    u64 *slot = llmdiag_errors.lookup(&which);
    if (slot)
        __sync_fetch_and_add(slot, 1);
}

static __always_inline void count_global(u32 which)
{
    u64 *slot = globals.lookup(&which);
    if (slot)
        __sync_fetch_and_add(slot, 1);
}

static __always_inline u8 port_role(u16 port)
{
    u8 *role = ports.lookup(&port);
    return role ? *role : 0;
}

static __always_inline int is_v4_mapped(const u8 *a)
{
    return a[0] == 0 && a[1] == 0 && a[2] == 0 && a[3] == 0 && a[4] == 0 && a[5] == 0 &&
           a[6] == 0 && a[7] == 0 && a[8] == 0 && a[9] == 0 && a[10] == 0xff && a[11] == 0xff;
}

static __always_inline int is_own(u16 local, u16 remote)
{
    u32 pair = ((u32)local << 16) | remote;
    return own_conns.lookup(&pair) != 0;
}

/* key->family and key->addr from an address (v4-mapped IPv6 is stored as IPv4). */
static __always_inline void set_addr(struct endpoint_key *key, u16 family, const u8 addr4[4], const u8 addr6[16])
{
    if (family == FAMILY_INET6) {
        if (is_v4_mapped(addr6)) {
            key->family = FAMILY_INET;
            __builtin_memcpy(key->addr, addr6 + 12, 4);
        } else {
            key->family = FAMILY_INET6;
            __builtin_memcpy(key->addr, addr6, 16);
        }
    } else {
        key->family = FAMILY_INET;
        __builtin_memcpy(key->addr, addr4, 4);
    }
}

/* Fill key for a connection: local laddr:lport, remote raddr:rport (the 4-byte
 * form for IPv4, the 16-byte one for IPv6). Server side wins when both ends are
 * ports of interest. The server side keeps its local address: engines in pods
 * each listen on the same port (8000) in their own network namespace, and the
 * address the client reached (the pod IP) is what tells them apart.
 * Returns 1 on a match. */
static __always_inline int classify(struct endpoint_key *key, u16 family, u16 lport, u16 rport,
                                    const u8 laddr4[4], const u8 laddr6[16],
                                    const u8 raddr4[4], const u8 raddr6[16])
{
    __builtin_memset(key, 0, sizeof(*key));
    /* llmdiag's own scrape, seen from its end (client) or from the engine's end on this host. */
    if (lport && rport && (is_own(lport, rport) || is_own(rport, lport)))
        return 0;
    if (lport && (port_role(lport) & ROLE_SERVER)) {
        key->side = SIDE_SERVER;
        key->port = lport;
        set_addr(key, family, laddr4, laddr6);
        return 1;
    }
    if (!rport || !(port_role(rport) & ROLE_CLIENT))
        return 0;
    key->side = SIDE_CLIENT;
    key->port = rport;
    set_addr(key, family, raddr4, raddr6);
    return 1;
}

static __always_inline struct tcp_stats *stats_for(struct endpoint_key *key)
{
    struct tcp_stats zero = {};
    struct tcp_stats *s = stats.lookup_or_try_init(key, &zero);
    if (!s)
        count_error(LLMDIAG_ERR_MAP_FULL);
    return s;
}

/* A sockaddr_in / sockaddr_in6 as the tcp_send_reset and tcp_probe tracepoints store it. */
static __always_inline int classify_sockaddrs(struct endpoint_key *key, const u8 *local, const u8 *remote)
{
    u16 family = local[0] | (local[1] << 8);
    u16 lport = (local[2] << 8) | local[3];
    u16 rport = (remote[2] << 8) | remote[3];
    u8 l4[4], r4[4];
    u8 l6[16], r6[16];
    __builtin_memcpy(l4, local + 4, 4);
    __builtin_memcpy(l6, local + 8, 16);
    __builtin_memcpy(r4, remote + 4, 4);
    __builtin_memcpy(r6, remote + 8, 16);
    return classify(key, family, lport, rport, l4, l6, r4, r6);
}

static __always_inline u32 latency_slot(u64 ns)
{
    u64 us = ns / 1000;
    if (us < 4)
        return (u32)us;
    u32 e = bpf_log2l(us) - 1; /* floor(log2(us)) >= 2 */
    return e * 4 + (u32)((us >> (e - 2)) & 3);
}

/* -- connection lifecycle ------------------------------------------------------ */

TRACEPOINT_PROBE(sock, inet_sock_set_state)
{
    if (args->protocol != IPPROTO_TCP)
        return 0;
    u64 sk = (u64)args->skaddr;
    int oldstate = args->oldstate;
    int newstate = args->newstate;
    u32 prot_slot = args->family == FAMILY_INET6 ? 1 : 0;
    u64 *known_prot = tcp_prots.lookup(&prot_slot);
    if (known_prot && *known_prot == 0) {
        struct sock_common_head learn = {};
        if (bpf_probe_read_kernel(&learn, sizeof(learn), (void *)sk) == 0 && learn.prot)
            *known_prot = learn.prot;
    }
    u8 saddr[4], daddr[4];
    u8 saddr6[16], daddr6[16];
    __builtin_memcpy(saddr, args->saddr, 4);
    __builtin_memcpy(saddr6, args->saddr_v6, 16);
    __builtin_memcpy(daddr, args->daddr, 4);
    __builtin_memcpy(daddr6, args->daddr_v6, 16);
    struct endpoint_key key;
    if (!classify(&key, args->family, args->sport, args->dport, saddr, saddr6, daddr, daddr6))
        return 0;

    /* Cross-check the struct sock_common read that endpoint_of() relies on, on
     * live sockets only: the local port (skc_num) is still 0 at CLOSE -> SYN_SENT
     * and is released (inet_put_port) on the way to CLOSE. */
    if (oldstate != TCP_CLOSE && newstate != TCP_CLOSE) {
        struct sock_common_head head = {};
        if (bpf_probe_read_kernel(&head, sizeof(head), (void *)sk) == 0) {
            count_global(G_SOCK_COMMON_CHECKS);
            int bad = head.num != args->sport || ntohs(head.dport) != args->dport ||
                      head.family != args->family || (known_prot && head.prot != *known_prot);
            if (args->family == FAMILY_INET) {
                u32 d4 = 0, s4 = 0;
                __builtin_memcpy(&d4, daddr, 4);
                __builtin_memcpy(&s4, saddr, 4);
                bad |= head.daddr != d4 || head.rcv_saddr != s4;
            } else {
                u64 a[2], b[2], c[2], d[2]; /* no memcmp in BPF: compare as two words */
                __builtin_memcpy(a, head.v6_daddr, 16);
                __builtin_memcpy(b, daddr6, 16);
                __builtin_memcpy(c, head.v6_rcv_saddr, 16);
                __builtin_memcpy(d, saddr6, 16);
                bad |= a[0] != b[0] || a[1] != b[1] || c[0] != d[0] || c[1] != d[1];
            }
            if (bad)
                count_global(G_SOCK_COMMON_MISMATCH);
        } else {
            count_error(LLMDIAG_ERR_READ);
        }
    }

    struct tcp_stats *s = stats_for(&key);
    if (!s)
        return 0;
    u64 now = bpf_ktime_get_ns();

    if (newstate == TCP_SYN_SENT) {
        if (connect_start.update(&sk, &now))
            count_error(LLMDIAG_ERR_MAP_FULL);
    }
    if (newstate == TCP_ESTABLISHED) {
        __sync_fetch_and_add(&s->established, 1);
        __sync_fetch_and_add(&s->opened, 1);
        if (socks.update(&sk, &key))
            count_error(LLMDIAG_ERR_MAP_FULL);
        if (oldstate == TCP_SYN_SENT) {
            u64 *start = connect_start.lookup(&sk);
            if (start) {
                u64 delta = now - *start;
                connect_start.delete(&sk);
                __sync_fetch_and_add(&s->connects, 1);
                __sync_fetch_and_add(&s->connect_ns, delta);
                struct hist_key hk = {};
                hk.ep = key;
                hk.slot = latency_slot(delta);
                u64 zero = 0;
                u64 *bucket = connect_hist.lookup_or_try_init(&hk, &zero);
                if (bucket)
                    __sync_fetch_and_add(bucket, 1);
                else
                    count_error(LLMDIAG_ERR_MAP_FULL);
            }
        }
    } else if (oldstate == TCP_ESTABLISHED) {
        __sync_fetch_and_add(&s->established, -1);
        if (newstate == TCP_CLOSE_WAIT)
            __sync_fetch_and_add(&s->peer_closes, 1);
    }
    /* TIME_WAIT is a separate socket: the full socket goes FIN_WAIT2/CLOSING -> CLOSE
     * as the timewait socket is born (tcp_time_wait()). LAST_ACK -> CLOSE is the
     * passive closer finishing and makes no TIME_WAIT socket. */
    if (newstate == TCP_CLOSE) {
        if (oldstate == TCP_FIN_WAIT2 || oldstate == TCP_CLOSING)
            __sync_fetch_and_add(&s->active_closes, 1);
        socks.delete(&sk);
        connect_start.delete(&sk);
    }
    return 0;
}

/* -- sends ------------------------------------------------------------------------ */

/* The endpoint of a socket, from the socks map or, for sockets opened before
 * the program was loaded, from struct sock_common (IPv4, and IPv6 server side). */
static __always_inline struct endpoint_key *endpoint_of(u64 sk, int known_tcp)
{
    struct endpoint_key *known = socks.lookup(&sk);
    if (known)
        return known;
    struct sock_common_head head = {};
    if (bpf_probe_read_kernel(&head, sizeof(head), (void *)sk) != 0) {
        count_error(LLMDIAG_ERR_READ);
        return 0;
    }
    if (head.family != FAMILY_INET && head.family != FAMILY_INET6)
        return 0;
    if (!known_tcp) {
        /* raw tracepoint: no protocol argument; only a TCP socket has skc_prot == &tcp_prot. */
        u32 prot_slot = head.family == FAMILY_INET6 ? 1 : 0;
        u64 *prot = tcp_prots.lookup(&prot_slot);
        if (!prot || *prot == 0 || head.prot != *prot)
            return 0;
    }
    struct endpoint_key key;
    u8 l4[4], r4[4];
    __builtin_memcpy(l4, &head.rcv_saddr, 4);
    __builtin_memcpy(r4, &head.daddr, 4);
    if (!classify(&key, head.family, head.num, ntohs(head.dport), l4, head.v6_rcv_saddr, r4, head.v6_daddr))
        return 0;
    if (socks.update(&sk, &key)) {
        count_error(LLMDIAG_ERR_MAP_FULL);
        return 0;
    }
    count_global(G_LAZY_FILLS);
    return socks.lookup(&sk);
}

static __always_inline void account_send(u64 sk, int ret, int known_tcp)
{
    struct endpoint_key *ep = endpoint_of(sk, known_tcp);
#if SEND_TIMING
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 *start = send_start.lookup(&tid);
    u64 elapsed = 0;
    if (start) {
        elapsed = bpf_ktime_get_ns() - *start;
        send_start.delete(&tid);
    }
#endif
    if (!ep)
        return;
    struct endpoint_key key = *ep;
    struct tcp_stats *s = stats_for(&key);
    if (!s)
        return;
    if (ret > 0) {
        __sync_fetch_and_add(&s->send_bytes, ret);
        __sync_fetch_and_add(&s->sends, 1);
    } else if (ret == -EAGAIN) {
        __sync_fetch_and_add(&s->send_eagain, 1);
    }
#if SEND_TIMING
    if (elapsed) {
        __sync_fetch_and_add(&s->send_block_ns, elapsed);
        if (elapsed >= SEND_BLOCK_NS)
            __sync_fetch_and_add(&s->send_blocked, 1);
    }
#endif
}

#if SEND_PATH == 1
TRACEPOINT_PROBE(sock, sock_send_length)
{
    if (args->protocol != IPPROTO_TCP)
        return 0;
    account_send((u64)args->sk, args->ret, 1);
    return 0;
}
#elif SEND_PATH == 3
/* The same tracepoint attached raw: no perf record is built for each send
 * (the cheaper path; args are sock_send_length(sk, ret, flags)). */
RAW_TRACEPOINT_PROBE(sock_send_length)
{
    account_send((u64)ctx->args[0], (int)ctx->args[1], 0);
    return 0;
}
#elif SEND_PATH == 2
/* Older kernels (no sock_send_length): kprobe tcp_sendmsg, result from the kretprobe. */
BPF_HASH(sendmsg_sk, u32, u64, 16384);

int on_tcp_sendmsg(struct pt_regs *ctx, void *sk)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 skp = (u64)sk;
    if (sendmsg_sk.update(&tid, &skp))
        count_error(LLMDIAG_ERR_MAP_FULL);
    return 0;
}

int on_tcp_sendmsg_ret(struct pt_regs *ctx)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 *skp = sendmsg_sk.lookup(&tid);
    if (!skp)
        return 0;
    u64 sk = *skp;
    sendmsg_sk.delete(&tid);
    account_send(sk, (int)PT_REGS_RC(ctx), 1);
    return 0;
}
#endif

#if SEND_TIMING
/* Entry time of send-family syscalls of the timed pids (the backend processes):
 * time spent inside send() is the send-buffer wait of blocking senders. */
static __always_inline int send_enter(void)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!timed_pids.lookup(&tgid))
        return 0;
    u32 tid = (u32)id;
    u64 now = bpf_ktime_get_ns();
    if (send_start.update(&tid, &now))
        count_error(LLMDIAG_ERR_MAP_FULL);
    return 0;
}

/* write()/writev() also go to files and pipes: forget the entry when the
 * syscall ends so a later send path without a syscall cannot pick it up. */
static __always_inline int send_exit(void)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!timed_pids.lookup(&tgid))
        return 0;
    u32 tid = (u32)id;
    send_start.delete(&tid);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_sendto) { return send_enter(); }
TRACEPOINT_PROBE(syscalls, sys_enter_sendmsg) { return send_enter(); }
TRACEPOINT_PROBE(syscalls, sys_enter_write) { return send_enter(); }
TRACEPOINT_PROBE(syscalls, sys_enter_writev) { return send_enter(); }
TRACEPOINT_PROBE(syscalls, sys_exit_write) { return send_exit(); }
TRACEPOINT_PROBE(syscalls, sys_exit_writev) { return send_exit(); }
#endif

/* -- retransmits, resets, rtt, memory pressure ----------------------------------------- */

#if HAVE_RETRANSMIT
TRACEPOINT_PROBE(tcp, tcp_retransmit_skb)
{
    u8 saddr[4], daddr[4];
    u8 saddr6[16], daddr6[16];
    __builtin_memcpy(saddr, args->saddr, 4);
    __builtin_memcpy(saddr6, args->saddr_v6, 16);
    __builtin_memcpy(daddr, args->daddr, 4);
    __builtin_memcpy(daddr6, args->daddr_v6, 16);
    struct endpoint_key key;
    if (!classify(&key, args->family, args->sport, args->dport, saddr, saddr6, daddr, daddr6))
        return 0;
    struct tcp_stats *s = stats_for(&key);
    if (s)
        __sync_fetch_and_add(&s->retransmits, 1);
    return 0;
}
#endif

#if HAVE_SEND_RESET
#if DECLARE_SK_RST_REASON
/* 6.10+ tcp_send_reset has a field of this enum; headers older than 6.10
 * (bcc here compiles against 6.1's) do not define it. Only its size matters. */
enum sk_rst_reason { LLMDIAG_SK_RST_REASON_PLACEHOLDER = 0 };
#endif
TRACEPOINT_PROBE(tcp, tcp_send_reset)
{
    /* saddr is the local end whether the RST comes from a socket or, with no
     * socket, from the reversed 4-tuple of the offending skb. */
    u8 local[28];
    u8 remote[28];
    __builtin_memcpy(local, args->saddr, 28);
    __builtin_memcpy(remote, args->daddr, 28);
    struct endpoint_key key;
    if (!classify_sockaddrs(&key, local, remote))
        return 0;
    struct tcp_stats *s = stats_for(&key);
    if (s)
        __sync_fetch_and_add(&s->resets_sent, 1);
    return 0;
}
#endif

#if HAVE_RECEIVE_RESET
TRACEPOINT_PROBE(tcp, tcp_receive_reset)
{
    u8 saddr[4], daddr[4];
    u8 saddr6[16], daddr6[16];
    __builtin_memcpy(saddr, args->saddr, 4);
    __builtin_memcpy(saddr6, args->saddr_v6, 16);
    __builtin_memcpy(daddr, args->daddr, 4);
    __builtin_memcpy(daddr6, args->daddr_v6, 16);
    struct endpoint_key key;
    if (!classify(&key, args->family, args->sport, args->dport, saddr, saddr6, daddr, daddr6))
        return 0;
    struct tcp_stats *s = stats_for(&key);
    if (s)
        __sync_fetch_and_add(&s->resets_received, 1);
    return 0;
}
#endif

#if HAVE_TCP_PROBE
TRACEPOINT_PROBE(tcp, tcp_probe)
{
    /* Fires for every received segment on an established socket: filter by
     * port first (one or two lookups), then sample. */
    u8 lrole = port_role(args->sport);
    u8 rrole = port_role(args->dport);
    if (!(lrole & ROLE_SERVER) && !(rrole & ROLE_CLIENT))
        return 0;
#if SRTT_SAMPLE_MASK
    if (bpf_get_prandom_u32() & SRTT_SAMPLE_MASK)
        return 0;
#endif
    u8 local[28];
    u8 remote[28];
    __builtin_memcpy(local, args->saddr, 28);
    __builtin_memcpy(remote, args->daddr, 28);
    struct endpoint_key key;
    if (!classify_sockaddrs(&key, local, remote))
        return 0;
    struct tcp_stats *s = stats_for(&key);
    if (!s)
        return 0;
    u64 srtt_us = args->srtt; /* tp->srtt_us >> 3: microseconds */
    __sync_fetch_and_add(&s->srtt_us_sum, srtt_us);
    __sync_fetch_and_add(&s->srtt_samples, 1);
    s->srtt_us_last = srtt_us;
    return 0;
}
#endif

#if HAVE_EXCEED_BUF
TRACEPOINT_PROBE(sock, sock_exceed_buf_limit)
{
    /* Protocol-wide memory pressure (tcp_mem exceeded), not one socket's buffer. */
    char name[4] = {};
    __builtin_memcpy(name, args->name, 4);
    if (name[0] != 'T' || name[1] != 'C' || name[2] != 'P' || name[3] != 0)
        return 0;
    count_global(args->kind == 0 ? G_EXCEED_BUF_SEND : G_EXCEED_BUF_RECV);
    return 0;
}
#endif
