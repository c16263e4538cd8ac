/* tcp_health.bpf.c <-> llmdiag/collectors/tcp.py: the only definition of the
 * structs and enums both sides read (the collector mirrors them in ctypes-free
 * form through bcc's table types; keep field names in sync with tcp.py). */
#ifndef LLMDIAG_TCP_HEALTH_H
#define LLMDIAG_TCP_HEALTH_H

/* ports map value: which side of a connection a port of interest is on. */
enum port_role {
    ROLE_SERVER = 1, /* a backend listens on this local port */
    ROLE_CLIENT = 2, /* local clients connect to this remote port (a gateway on this host) */
};

/* endpoint_key.side */
enum endpoint_side {
    SIDE_SERVER = 1, /* key: local ip:port (the address the client reached: a pod IP, the node's, loopback) */
    SIDE_CLIENT = 2, /* key: remote ip:port */
};

struct endpoint_key {
    __u8 side;      /* enum endpoint_side */
    __u8 family;    /* 2 = AF_INET (addr[0..3]), 10 = AF_INET6; v4-mapped v6 is stored as AF_INET */
    __u16 port;     /* host byte order */
    __u8 addr[16];  /* local address for SIDE_SERVER, remote address for SIDE_CLIENT */
};

/* Cumulative per-endpoint counters; user space takes deltas. */
struct tcp_stats {
    __u64 send_bytes;       /* sock:sock_send_length ret > 0 */
    __u64 sends;            /* successful send calls */
    __u64 send_eagain;      /* send returned -EAGAIN: send buffer full (non-blocking senders) */
    __u64 send_blocked;     /* blocking sends that took >= SEND_BLOCK_NS (timed pids only) */
    __u64 send_block_ns;    /* time inside send syscalls (timed pids only) */
    __u64 retransmits;      /* tcp:tcp_retransmit_skb */
    __u64 resets_sent;      /* tcp:tcp_send_reset */
    __u64 resets_received;  /* tcp:tcp_receive_reset */
    __s64 established;      /* +1 on entering ESTABLISHED, -1 on leaving it (since load) */
    __u64 opened;           /* entries into ESTABLISHED */
    __u64 connects;         /* SYN_SENT -> ESTABLISHED (client side) */
    __u64 connect_ns;       /* sum of connect latencies */
    __u64 peer_closes;      /* ESTABLISHED -> CLOSE_WAIT */
    __u64 active_closes;    /* FIN_WAIT2/CLOSING -> CLOSE: the socket became a TIME_WAIT socket */
    __u64 srtt_us_sum;      /* sampled tcp:tcp_probe srtt */
    __u64 srtt_samples;
    __u64 srtt_us_last;
};

/* connect latency histogram: 4 buckets per power of two of microseconds
 * (slot = us for us < 4, else 4 * floor(log2(us)) + next two bits). */
struct hist_key {
    struct endpoint_key ep;
    __u32 slot;
};

/* globals array indices */
enum tcp_global {
    G_EXCEED_BUF_SEND = 0,   /* sock:sock_exceed_buf_limit, TCP, SK_MEM_SEND: protocol-wide memory pressure */
    G_EXCEED_BUF_RECV = 1,
    G_LAZY_FILLS = 2,        /* sockets attributed from struct sock_common on first send (opened before load) */
    G_SOCK_COMMON_CHECKS = 3,/* inet_sock_set_state events where sock_common was read and compared */
    G_SOCK_COMMON_MISMATCH = 4, /* ... and disagreed with the tracepoint: lazy fill is not trustworthy */
    G_MAX = 8,
};

#endif /* LLMDIAG_TCP_HEALTH_H */
