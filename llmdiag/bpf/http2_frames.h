/* http2_frames.bpf.c <-> llmdiag/collectors/http2.py: the only definition of
 * the structs and enums both sides read. Keep field names in sync with
 * llmdiag/collectors/h2_kernel.py (which reads them by name through bcc's
 * table types).
 *
 * Directions are seen from the traced process (the gRPC backend):
 * H2_DIR_RECEIVED = frames it read from the socket, H2_DIR_SENT = frames it
 * wrote. */
#ifndef LLMDIAG_HTTP2_FRAMES_H
#define LLMDIAG_HTTP2_FRAMES_H

/* Bytes kept per direction to assemble a frame header plus the part of the
 * payload the program needs (RST_STREAM/GOAWAY error code, WINDOW_UPDATE
 * increment, up to H2_SETTINGS_PEEK SETTINGS entries), even when they arrive
 * split across iovecs or syscalls. */
#define H2_FRAME_HEADER 9
#define H2_SETTINGS_PEEK 6                  /* entries of 6 bytes */
#define H2_PEEK_MAX (H2_FRAME_HEADER + 6 * H2_SETTINGS_PEEK) /* 45 */
#define H2_PEEK_BUF 112                     /* >= 63 + H2_PEEK_MAX: the verifier sees offset <= 63 (a 6-bit mask) and size <= 45 */
#define H2_PREFACE_LEN 24                   /* "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" */
#define H2_CODES 16                         /* RFC 9113 error codes 0..13; slot 15 = any other code */
#define H2_CODE_OTHER 15

enum h2_dir {
    H2_DIR_RECEIVED = 0,
    H2_DIR_SENT = 1,
};

/* RFC 9113 section 6 frame types */
enum h2_frame_type {
    H2_DATA = 0,
    H2_HEADERS = 1,
    H2_PRIORITY = 2,
    H2_RST_STREAM = 3,
    H2_SETTINGS = 4,
    H2_PUSH_PROMISE = 5,
    H2_PING = 6,
    H2_GOAWAY = 7,
    H2_WINDOW_UPDATE = 8,
    H2_CONTINUATION = 9,
};

#define H2_FLAG_END_STREAM 0x1
#define H2_FLAG_ACK 0x1
#define H2_SETTINGS_INITIAL_WINDOW_SIZE 0x4
#define H2_DEFAULT_WINDOW 65535

/* h2_conn.state */
enum h2_conn_state {
    H2_STATE_UNKNOWN = 0,   /* a backend-port socket; not (yet) known to speak HTTP/2 */
    H2_STATE_PREFACE = 1,   /* part of the client preface received, the rest still owed */
    H2_STATE_CONFIRMED = 2, /* preface seen, or a whole buffer of valid frames (re-sync) */
};

/* h2_conn.origin */
enum h2_origin {
    H2_ORIGIN_USER = 1,    /* pushed by user space from /proc/PID/fd + /proc/net/tcp */
    H2_ORIGIN_PREFACE = 2, /* created by the program when a watched pid read the preface */
};

/* per-tid syscall arguments saved at sys_enter_*, walked at sys_exit_* */
enum h2_call_kind {
    H2_CALL_BUF = 1, /* write/sendto/read/recvfrom: one buffer */
    H2_CALL_IOV = 2, /* writev/readv: an iovec array */
    H2_CALL_MSG = 3, /* sendmsg/recvmsg: a user msghdr */
};

struct h2_call {
    __u64 ptr;    /* buffer, iovec array or msghdr (user memory) */
    __u64 count;  /* buffer size or iovec count */
    __u32 fd;
    __u8 kind;    /* enum h2_call_kind */
    __u8 dir;     /* enum h2_dir */
    __u16 pad;
};

/* watched_pids value: the backend listen port a pid serves (the first one if
 * it serves several; connections pushed from user space carry their own). */
struct h2_pid {
    __u16 port;
    __u16 pad;
    __u32 pad2;
};

struct h2_conn_key {
    __u32 tgid;
    __u32 fd;
};

/* Frame-walking state of one direction of one connection. */
struct h2_dir_state {
    __u32 carry;   /* payload bytes of the current frame still to skip */
    __u8 synced;   /* the next byte is known to be a frame boundary (or carry/have say where we are) */
    __u8 have;     /* bytes of buf assembled so far */
    __u8 want;     /* bytes needed: 9, or 9 + the payload prefix the frame type needs */
    __u8 pad;
    __u8 buf[H2_PEEK_BUF];
};

struct h2_conn {
    __u64 created_ns;
    __u64 stalls;            /* flow-control stalls on this connection (see docs/http2.md) */
    __u64 rst_stream;        /* RST_STREAM frames, both directions */
    __u64 goaway;            /* GOAWAY frames, both directions */
    __u64 send_eagain;       /* sends that returned -EAGAIN (socket buffer full) */
    __u64 desyncs;           /* invalid frame header while synced: parsing paused until re-sync */
    __u64 conn_exhausted_ns; /* when the connection-level send window reached <= 0 (0 = open) */
    __s64 conn_send_window;  /* connection-level window the peer granted us */
    __u32 peer_initial_window; /* peer's SETTINGS_INITIAL_WINDOW_SIZE (stream send windows) */
    __u32 max_client_sid;    /* highest client-initiated stream id seen in a received HEADERS */
    __u16 port;              /* backend listen port this connection belongs to */
    __u8 state;              /* enum h2_conn_state */
    __u8 preface_matched;    /* bytes of the preface seen so far (0..24) */
    __u8 origin;             /* enum h2_origin */
    __u8 pad[3];
    struct h2_dir_state dir[2];
};

struct h2_stream_key {
    __u32 tgid;
    __u32 fd;
    __u32 sid;
    __u32 pad;
};

/* One client-initiated stream seen opening (HEADERS received). */
struct h2_stream {
    __s64 send_window;   /* stream-level window the peer granted us, minus DATA sent */
    __u64 exhausted_ns;  /* when send_window reached <= 0 (0 = window open) */
    __u8 end_received;   /* END_STREAM seen from the peer */
    __u8 end_sent;       /* END_STREAM sent by us */
    __u8 pad[6];
};

struct h2_stats_key {
    __u16 port; /* backend listen port */
    __u8 dir;   /* enum h2_dir */
    __u8 pad;
};

/* Cumulative per-backend-port, per-direction counters; user space takes deltas. */
struct h2_stats {
    __u64 frames;
    __u64 data_frames;
    __u64 data_bytes;
    __u64 headers;
    __u64 streams_opened;  /* HEADERS received opening a new client stream (dir = received only) */
    __u64 streams_closed;  /* stream reached "closed": END_STREAM both ways or RST_STREAM; dir = the closing frame's */
    __u64 end_stream;      /* frames carrying END_STREAM */
    __u64 settings;
    __u64 pings;
    __u64 window_updates;
    __u64 stalls;          /* flow-control stalls ended by the frame in this direction */
    __u64 send_eagain;     /* dir = sent only */
    __u64 desyncs;
    __u64 truncated;       /* syscalls with more frames than the walker runs allow: rest skipped, direction re-syncs */
    __u64 rst_stream[H2_CODES];
    __u64 goaway[H2_CODES];
};

/* Ring-buffer record for each RST_STREAM and GOAWAY (rare). */
struct h2_event {
    __u64 ts_ns;             /* bpf_ktime_get_ns() (CLOCK_MONOTONIC) */
    __u64 conn_stalls;       /* the connection's stall count when the frame was seen */
    __u64 stream_stalled_ns; /* how long the stream's send window had been exhausted (0 = not) */
    __u32 tgid;
    __u32 fd;
    __u32 stream_id;         /* RST_STREAM: the stream; GOAWAY: 0 */
    __u32 error_code;
    __u32 last_stream_id;    /* GOAWAY only */
    __u16 port;
    __u8 frame_type;         /* H2_RST_STREAM or H2_GOAWAY */
    __u8 dir;                /* enum h2_dir */
};

/* Per-CPU scratch: where the walk of the current syscall is (kept here
 * between the walker's tail calls). iovecs are read one at a time, when the
 * walk reaches them, so a call may have any number of them. */
struct h2_segments {
    __u64 iov_ptr;  /* user iovec array (0 for a plain buffer) */
    __u64 cur_ptr;  /* current buffer */
    __u64 cur_len;
    __u64 now;
    __u64 left;    /* bytes still to walk */
    __u64 off;     /* offset in segment idx */
    __u32 count;   /* buffers: 1, or the iovec count */
    __u32 idx;     /* current buffer */
    __u32 tgid;
    __u32 fd;
    __u32 frames;  /* frames completed in this call */
    __u32 rounds;  /* walker runs so far */
    __u8 dir;
    __u8 counting; /* direction synced on a confirmed connection when the call began */
    __u8 was_synced;
    __u8 ok;
    __u32 pad;
    __u8 peek[32]; /* preface bytes */
};

#endif /* LLMDIAG_HTTP2_FRAMES_H */
