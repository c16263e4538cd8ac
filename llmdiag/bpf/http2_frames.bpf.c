/* HTTP/2 (h2c) frame counter for gRPC backends, from syscall tracepoints only.
 *
 * For the pids in watched_pids, every read/recvfrom/readv/recvmsg and
 * write/sendto/writev/sendmsg has its arguments saved at sys_enter_* and is
 * walked at sys_exit_* over the bytes the call really moved (ret), so partial
 * writes and EAGAIN are right. Only (pid, fd) pairs in `conns` are walked:
 * user space pushes the TCP sockets on backend ports each tick, and the
 * program adds a connection itself when a watched pid reads the client
 * preface on an unknown fd (connections that start between two ticks).
 *
 * Frames are found by walking 9-byte headers across the iovecs of a call and
 * across calls: per connection and direction the state keeps the payload bytes
 * still owed to the current frame (`carry`) and the header bytes assembled so
 * far (`have`/`want`), so a frame split over two writes, and a header or the
 * first payload bytes split over two writes or two iovecs, are still parsed.
 * A direction that lost its place (connection older than the agent, invalid
 * header, too many frames in one call) re-syncs on the first call whose bytes
 * are exactly a whole number of valid frames; nothing is counted before that.
 *
 * Defines:
 *   H2_MAX_CONNS    size of conns (default 8192)
 *   H2_MAX_STREAMS  size of the streams LRU map (default 32768)
 *   H2_MAX_PIDS     size of watched_pids (default 256)
 *   H2_STEPS_PER_CALL walking steps per walker run (h2_walk, tail-called); a
 *                   frame takes 1-2, each further iovec 1 (default 8: more makes
 *                   the verifier's work grow fast)
 *   H2_MAX_ROUNDS   walker runs (tail calls) per syscall (default 32, at most 33)
 *   H2_STALL_NS     how long a send window must stay exhausted to be a stall (default 200 ms)
 *   H2_RINGBUF_PAGES ring buffer pages for RST_STREAM/GOAWAY events (default 16)
 */
#include <uapi/linux/ptrace.h>
#include <uapi/linux/uio.h>
#include <linux/socket.h>
#include "common.h"
#include "http2_frames.h"

#ifndef H2_MAX_CONNS
#define H2_MAX_CONNS 8192
#endif
#ifndef H2_MAX_STREAMS
#define H2_MAX_STREAMS 32768
#endif
#ifndef H2_MAX_PIDS
#define H2_MAX_PIDS 256
#endif
#ifndef H2_STEPS_PER_CALL
#define H2_STEPS_PER_CALL 8
#endif
#ifndef H2_MAX_ROUNDS
#define H2_MAX_ROUNDS 32 /* walker runs per syscall; the kernel allows 33 tail calls */
#endif
#ifndef H2_STALL_NS
#define H2_STALL_NS 200000000ULL
#endif
#ifndef H2_RINGBUF_PAGES
#define H2_RINGBUF_PAGES 16
#endif

#define EAGAIN_RET (-11)
#define LLMDIAG_ERR_TAIL_CALL 2 /* walker tail call failed (not installed) */

BPF_ARRAY(llmdiag_errors, u64, LLMDIAG_ERR_MAX);
BPF_HASH(watched_pids, u32, struct h2_pid, H2_MAX_PIDS);
BPF_HASH(conns, struct h2_conn_key, struct h2_conn, H2_MAX_CONNS);
BPF_TABLE("lru_hash", struct h2_stream_key, struct h2_stream, streams, H2_MAX_STREAMS);
BPF_HASH(h2_stats, struct h2_stats_key, struct h2_stats, 1024);
BPF_HASH(calls, u32, struct h2_call, 4096);
BPF_PERCPU_ARRAY(segments, struct h2_segments, 1);
BPF_PROG_ARRAY(walkers, 1);
/* Zero values and scratch too large for the 512-byte BPF stack. */
BPF_PERCPU_ARRAY(zero_stats, struct h2_stats, 1);
BPF_PERCPU_ARRAY(new_conn, struct h2_conn, 1);
BPF_RINGBUF_OUTPUT(h2_events, H2_RINGBUF_PAGES);

static __always_inline void count_error(u32 which)
{
    u64 *slot = llmdiag_errors.lookup(&which);
    if (slot)
        __sync_fetch_and_add(slot, 1);
}

/* v & mask, with the mask kept even where clang can prove it redundant: the
 * verifier needs it to see the bound. */
static __always_inline u64 bounded(u64 v, u64 mask)
{
    asm volatile("" : "+r"(v));
    return v & mask;
}

static __always_inline u32 be32(const u8 *p)
{
    return ((u32)p[0] << 24) | ((u32)p[1] << 16) | ((u32)p[2] << 8) | (u32)p[3];
}

/* Byte i of "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" without a .rodata table
 * (bcc 0.26 has no global data): the preface as three little-endian words. */
static __always_inline u8 preface_byte(u32 i)
{
    u64 word = i < 8 ? 0x5448202a20495250ULL : (i < 16 ? 0x0a0d302e322f5054ULL : 0x0a0d0a0d4d530a0dULL);
    return (u8)(word >> ((i & 7) * 8));
}

static __always_inline struct h2_stats *stats_for(u16 port, u8 dir)
{
    struct h2_stats_key key = {.port = port, .dir = dir};
    struct h2_stats *stats = h2_stats.lookup(&key);
    if (stats)
        return stats;
    u32 slot = 0;
    struct h2_stats *zero = zero_stats.lookup(&slot); /* never written: all zero */
    if (!zero)
        return 0;
    stats = h2_stats.lookup_or_try_init(&key, zero);
    if (!stats)
        count_error(LLMDIAG_ERR_MAP_FULL);
    return stats;
}

static __always_inline u32 code_slot(u32 code)
{
    return bounded(code <= 13 ? code : H2_CODE_OTHER, H2_CODES - 1);
}

/* A header that cannot start a frame: unknown type (only while re-syncing),
 * or a length or stream id RFC 9113 forbids for the type. */
static __always_inline int header_valid(u32 len, u8 type, u8 flags, u32 sid, int synced)
{
    switch (type) {
    case H2_DATA:
    case H2_HEADERS:
    case H2_CONTINUATION:
        return sid != 0;
    case H2_PRIORITY:
        return sid != 0 && len == 5;
    case H2_RST_STREAM:
        return sid != 0 && len == 4;
    case H2_SETTINGS:
        return sid == 0 && (len % 6) == 0 && (!(flags & H2_FLAG_ACK) || len == 0);
    case H2_PUSH_PROMISE:
        return sid != 0 && len >= 4;
    case H2_PING:
        return sid == 0 && len == 8;
    case H2_GOAWAY:
        return sid == 0 && len >= 8;
    case H2_WINDOW_UPDATE:
        return len == 4;
    default:
        return synced; /* extension frames are legal once we know where frames start */
    }
}

/* Payload bytes a frame type needs parsed (they are assembled with the header). */
static __always_inline u32 payload_peek(u8 type, u8 flags, u32 len, u8 dir)
{
    if (type == H2_RST_STREAM || type == H2_WINDOW_UPDATE)
        return 4;
    if (type == H2_GOAWAY)
        return 8;
    if (type == H2_SETTINGS && dir == H2_DIR_RECEIVED && !(flags & H2_FLAG_ACK))
        return len < 6 * H2_SETTINGS_PEEK ? len : 6 * H2_SETTINGS_PEEK;
    return 0;
}

static __always_inline void emit_event(struct h2_conn_key *key, struct h2_conn *conn, u8 type, u8 dir,
                                       u32 sid, u32 code, u32 last_sid, u64 stalled_ns, u64 now)
{
    struct h2_event ev = {};
    ev.ts_ns = now;
    ev.conn_stalls = conn->stalls;
    ev.stream_stalled_ns = stalled_ns;
    ev.tgid = key->tgid;
    ev.fd = key->fd;
    ev.stream_id = sid;
    ev.error_code = code;
    ev.last_stream_id = last_sid;
    ev.port = conn->port;
    ev.frame_type = type;
    ev.dir = dir;
    if (h2_events.ringbuf_output(&ev, sizeof(ev), 0) != 0)
        count_error(LLMDIAG_ERR_MAP_FULL);
}

/* The stream's send window was exhausted long enough to be a stall: count it. */
static __always_inline u64 end_stall(struct h2_conn *conn, struct h2_stats *stats, u64 exhausted_ns, u64 now)
{
    if (exhausted_ns == 0 || now < exhausted_ns)
        return 0;
    u64 stalled = now - exhausted_ns;
    if (stalled < H2_STALL_NS)
        return stalled;
    __sync_fetch_and_add(&conn->stalls, 1);
    if (stats)
        __sync_fetch_and_add(&stats->stalls, 1);
    return stalled;
}

/* One complete frame header (+ peeked payload) in d->buf: count it. */
static __always_inline void handle_frame(struct h2_conn_key *key, struct h2_conn *conn, struct h2_dir_state *d,
                                         u8 dir, u32 len, u8 type, u8 flags, u32 sid, u64 now)
{
    struct h2_stats *stats = stats_for(conn->port, dir);
    if (!stats)
        return;
    __sync_fetch_and_add(&stats->frames, 1);
    struct h2_stream_key skey = {.tgid = key->tgid, .fd = key->fd, .sid = sid};
    struct h2_stream *st;

    if (type == H2_DATA || type == H2_HEADERS) {
        if (type == H2_DATA) {
            __sync_fetch_and_add(&stats->data_frames, 1);
            __sync_fetch_and_add(&stats->data_bytes, len);
        } else {
            __sync_fetch_and_add(&stats->headers, 1);
        }
        if (type == H2_HEADERS && dir == H2_DIR_RECEIVED && (sid & 1) && sid > conn->max_client_sid) {
            conn->max_client_sid = sid;
            __sync_fetch_and_add(&stats->streams_opened, 1);
            struct h2_stream fresh = {};
            fresh.send_window = conn->peer_initial_window;
            if (streams.update(&skey, &fresh) != 0)
                count_error(LLMDIAG_ERR_MAP_FULL);
        }
        st = streams.lookup(&skey);
        if (type == H2_DATA && dir == H2_DIR_SENT) {
            conn->conn_send_window -= len;
            if (conn->conn_send_window <= 0 && conn->conn_exhausted_ns == 0)
                conn->conn_exhausted_ns = now;
            if (st) {
                st->send_window -= len;
                if (st->send_window <= 0 && st->exhausted_ns == 0)
                    st->exhausted_ns = now;
            }
        }
        if (flags & H2_FLAG_END_STREAM) {
            __sync_fetch_and_add(&stats->end_stream, 1);
            if (st) {
                if (dir == H2_DIR_SENT)
                    st->end_sent = 1;
                else
                    st->end_received = 1;
                if (st->end_sent && st->end_received) {
                    __sync_fetch_and_add(&stats->streams_closed, 1);
                    streams.delete(&skey);
                }
            }
        }
        return;
    }
    if (type == H2_RST_STREAM) {
        u32 code = be32(&d->buf[9]);
        __sync_fetch_and_add(&stats->rst_stream[code_slot(code)], 1);
        __sync_fetch_and_add(&conn->rst_stream, 1);
        u64 stalled = 0;
        st = streams.lookup(&skey);
        if (st) {
            stalled = end_stall(conn, stats, st->exhausted_ns, now);
            __sync_fetch_and_add(&stats->streams_closed, 1);
            streams.delete(&skey);
        }
        emit_event(key, conn, H2_RST_STREAM, dir, sid, code, 0, stalled, now);
        return;
    }
    if (type == H2_GOAWAY) {
        u32 last_sid = be32(&d->buf[9]) & 0x7fffffff;
        u32 code = be32(&d->buf[13]);
        __sync_fetch_and_add(&stats->goaway[code_slot(code)], 1);
        __sync_fetch_and_add(&conn->goaway, 1);
        emit_event(key, conn, H2_GOAWAY, dir, 0, code, last_sid, 0, now);
        return;
    }
    if (type == H2_WINDOW_UPDATE) {
        __sync_fetch_and_add(&stats->window_updates, 1);
        if (dir != H2_DIR_RECEIVED)
            return;
        u32 inc = be32(&d->buf[9]) & 0x7fffffff;
        if (sid == 0) {
            conn->conn_send_window += inc;
            if (conn->conn_send_window > 0 && conn->conn_exhausted_ns) {
                end_stall(conn, stats, conn->conn_exhausted_ns, now);
                conn->conn_exhausted_ns = 0;
            }
            return;
        }
        st = streams.lookup(&skey);
        if (st) {
            st->send_window += inc;
            if (st->send_window > 0 && st->exhausted_ns) {
                end_stall(conn, stats, st->exhausted_ns, now);
                st->exhausted_ns = 0;
            }
        }
        return;
    }
    if (type == H2_SETTINGS) {
        __sync_fetch_and_add(&stats->settings, 1);
        if (dir != H2_DIR_RECEIVED || (flags & H2_FLAG_ACK))
            return;
        /* SETTINGS_INITIAL_WINDOW_SIZE sets the windows of streams opened
         * later; a change does not re-base streams already open (documented). */
#pragma unroll
        for (int i = 0; i < H2_SETTINGS_PEEK; i++) {
            if ((u32)(i + 1) * 6 > len)
                break;
            u8 *entry = &d->buf[H2_FRAME_HEADER + i * 6];
            u32 id = ((u32)entry[0] << 8) | entry[1];
            if (id == H2_SETTINGS_INITIAL_WINDOW_SIZE)
                conn->peer_initial_window = be32(&entry[2]);
        }
        return;
    }
    if (type == H2_PING)
        __sync_fetch_and_add(&stats->pings, 1);
}

/* Up to H2_STEPS_PER_CALL walking steps over the call's bytes, from where
 * w->idx/off/left say. A step skips payload to the end of a frame or iovec,
 * or assembles header (+ peeked payload) bytes, and handles a frame once its
 * bytes are all there. Returns 1 when the walk is over (all bytes walked, or
 * an invalid header / read failure: w->ok = 0). */
static __always_inline int walk_steps(struct h2_conn_key *key, struct h2_conn *conn, struct h2_dir_state *d,
                                      struct h2_segments *w)
{
#pragma unroll
    for (int step = 0; step < H2_STEPS_PER_CALL; step++) {
        if (w->left == 0)
            return 1;
        u64 off = w->off;
        if (off >= w->cur_len) {
            /* next iovec, read from user memory only when the walk gets there */
            w->idx++;
            if (w->idx >= w->count) {
                w->ok = 0;
                return 1;
            }
            struct iovec iov = {};
            if (bpf_probe_read_user(&iov, sizeof(iov), (void *)(w->iov_ptr + (u64)w->idx * sizeof(struct iovec))) != 0) {
                count_error(LLMDIAG_ERR_READ);
                w->ok = 0;
                return 1;
            }
            w->cur_ptr = (u64)iov.iov_base;
            w->cur_len = iov.iov_len;
            w->off = 0;
            continue;
        }
        u64 sptr = w->cur_ptr;
        u64 avail = w->cur_len - off;
        if (avail > w->left)
            avail = w->left;
        if (d->carry) {
            /* skip the rest of the current frame's payload, then go on in the same step */
            u32 jump = d->carry < avail ? d->carry : (u32)avail;
            d->carry -= jump;
            off += jump;
            w->off = off;
            w->left -= jump;
            avail -= jump;
            if (avail == 0)
                continue;
        }
        u64 have = bounded(d->have, 0x3f);
        u64 want = bounded(d->want, 0x3f);
        if (have >= want || want > H2_PEEK_MAX || want < H2_FRAME_HEADER) {
            w->ok = 0;
            return 1;
        }
        u64 n = want - have;
        if (n > avail)
            n = avail;
        n = bounded(n, 0x3f); /* bounds the verifier can see: have <= 45, n <= 45, buf is 96 bytes */
        if (n == 0 || n > H2_PEEK_MAX || bpf_probe_read_user(&d->buf[have], n, (void *)(sptr + off)) != 0) {
            count_error(LLMDIAG_ERR_READ);
            w->ok = 0;
            return 1;
        }
        have += n;
        w->off = off + n;
        w->left -= n;
        d->have = have;
        if (have < want)
            continue; /* the rest arrives in the next iovec or the next call */

        u32 len = ((u32)d->buf[0] << 16) | ((u32)d->buf[1] << 8) | d->buf[2];
        u8 type = d->buf[3];
        u8 flags = d->buf[4];
        u32 sid = be32(&d->buf[5]) & 0x7fffffff;
        if (want == H2_FRAME_HEADER) {
            if (!header_valid(len, type, flags, sid, w->counting)) {
                w->ok = 0;
                return 1;
            }
            u32 peek = payload_peek(type, flags, len, w->dir);
            if (peek) {
                d->want = H2_FRAME_HEADER + peek;
                continue;
            }
        }
        w->frames++;
        if (w->counting)
            handle_frame(key, conn, d, w->dir, len, type, flags, sid, w->now);
        d->carry = len - (want - H2_FRAME_HEADER);
        d->have = 0;
        d->want = H2_FRAME_HEADER;
    }
    return w->left == 0;
}

/* The walk of one call is over: keep the direction's place, or give it up. */
static __always_inline void finish_walk(struct h2_conn *conn, struct h2_dir_state *d, struct h2_segments *w)
{
    if (w->ok && w->left != 0) {
        /* more frames than the steps allow: give up on this direction until it re-syncs */
        if (w->counting) {
            struct h2_stats *stats = stats_for(conn->port, w->dir);
            if (stats)
                __sync_fetch_and_add(&stats->truncated, 1);
        }
        w->ok = 0;
    }
    if (!w->ok) {
        if (w->counting) {
            __sync_fetch_and_add(&conn->desyncs, 1);
            struct h2_stats *stats = stats_for(conn->port, w->dir);
            if (stats)
                __sync_fetch_and_add(&stats->desyncs, 1);
        }
        d->synced = 0;
        d->carry = 0;
        d->have = 0;
        d->want = H2_FRAME_HEADER;
        return;
    }
    if (!w->was_synced && w->frames > 0 && d->carry == 0 && d->have == 0) {
        /* re-sync: this call was exactly a whole number of valid frames */
        d->synced = 1;
        if (conn->state == H2_STATE_UNKNOWN)
            conn->state = H2_STATE_CONFIRMED;
    }
}

/* The walking program: runs H2_STEPS_PER_CALL steps, then tail-calls itself
 * (the verifier checks H2_STEPS_PER_CALL steps once instead of every path
 * through a long loop). Loaded and put into `walkers` by user space. */
int h2_walk(void *ctx)
{
    u32 zero = 0;
    struct h2_segments *w = segments.lookup(&zero);
    if (!w)
        return 0;
    struct h2_conn_key key = {.tgid = w->tgid, .fd = w->fd};
    struct h2_conn *conn = conns.lookup(&key);
    if (!conn)
        return 0;
    struct h2_dir_state *d = w->dir == H2_DIR_SENT ? &conn->dir[1] : &conn->dir[0];
    if (!walk_steps(&key, conn, d, w)) {
        w->rounds++;
        if (w->rounds < H2_MAX_ROUNDS)
            walkers.call(ctx, 0);
        /* tail call limit reached (or failed): the rest of the call is not walked */
    }
    finish_walk(conn, d, w);
    return 0;
}

/* Match the client preface at the start of a received call. Returns the
 * preface bytes consumed (>0), 0 if the bytes are not the preface, or -1 if
 * the call ended inside the preface (state PREFACE, nothing left to walk). */
static __always_inline int match_preface(struct h2_conn *conn, struct h2_segments *seg, u64 total)
{
    u32 matched = conn->preface_matched;
    if (matched >= H2_PREFACE_LEN)
        matched = 0;
    u64 n = H2_PREFACE_LEN - matched;
    if (n > seg->cur_len)
        n = seg->cur_len;
    if (n > total)
        n = total;
    if (n == 0 || n > H2_PREFACE_LEN)
        return 0;
    if (bpf_probe_read_user(seg->peek, n, (void *)seg->cur_ptr) != 0) {
        count_error(LLMDIAG_ERR_READ);
        return 0;
    }
#pragma unroll
    for (u32 i = 0; i < H2_PREFACE_LEN; i++) {
        if (i >= n)
            break;
        if (seg->peek[i] != preface_byte(matched + i))
            return 0;
    }
    matched += n;
    conn->preface_matched = matched;
    if (matched < H2_PREFACE_LEN) {
        conn->state = H2_STATE_PREFACE;
        return -1;
    }
    /* A new HTTP/2 connection: both directions start on a frame boundary. */
    conn->state = H2_STATE_CONFIRMED;
    conn->conn_send_window = H2_DEFAULT_WINDOW;
    conn->conn_exhausted_ns = 0;
    conn->peer_initial_window = H2_DEFAULT_WINDOW;
    conn->max_client_sid = 0;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        conn->dir[i].synced = 1;
        conn->dir[i].carry = 0;
        conn->dir[i].have = 0;
        conn->dir[i].want = H2_FRAME_HEADER;
    }
    return (int)n;
}

/* Point the per-CPU walk state at the first buffer of the saved call. */
static __always_inline struct h2_segments *load_segments(struct h2_call *call)
{
    u32 zero = 0;
    struct h2_segments *seg = segments.lookup(&zero);
    if (!seg)
        return 0;
    seg->count = 0;
    seg->idx = 0;
    if (call->kind == H2_CALL_BUF) {
        seg->cur_ptr = call->ptr;
        seg->cur_len = call->count;
        seg->count = 1;
        return seg;
    }
    u64 iov_ptr = call->ptr;
    u64 iovlen = call->count;
    if (call->kind == H2_CALL_MSG) {
        struct user_msghdr msg = {};
        if (bpf_probe_read_user(&msg, sizeof(msg), (void *)call->ptr) != 0) {
            count_error(LLMDIAG_ERR_READ);
            return 0;
        }
        iov_ptr = (u64)msg.msg_iov;
        iovlen = msg.msg_iovlen;
    }
    if (iovlen == 0)
        return seg;
    struct iovec iov = {};
    if (bpf_probe_read_user(&iov, sizeof(iov), (void *)iov_ptr) != 0) {
        count_error(LLMDIAG_ERR_READ);
        return 0;
    }
    seg->iov_ptr = iov_ptr;
    seg->count = iovlen > 0xffffffffULL ? 0xffffffff : (u32)iovlen;
    seg->cur_ptr = (u64)iov.iov_base;
    seg->cur_len = iov.iov_len;
    return seg;
}

/* A watched pid read something on an fd we do not know yet: if it starts with
 * (a prefix of) the client preface, this is a new HTTP/2 connection. */
static __always_inline struct h2_conn *adopt_by_preface(struct h2_conn_key *key, struct h2_segments *seg, u64 total)
{
    if (total < 3 || seg->cur_len < 3)
        return 0;
    u8 head[3] = {};
    if (bpf_probe_read_user(head, sizeof(head), (void *)seg->cur_ptr) != 0)
        return 0;
    if (head[0] != 'P' || head[1] != 'R' || head[2] != 'I')
        return 0;
    struct h2_pid *pid = watched_pids.lookup(&key->tgid);
    if (!pid)
        return 0;
    u32 slot = 0;
    struct h2_conn *fresh = new_conn.lookup(&slot);
    if (!fresh)
        return 0;
    __builtin_memset(fresh, 0, sizeof(*fresh));
    fresh->created_ns = bpf_ktime_get_ns();
    fresh->port = pid->port;
    fresh->origin = H2_ORIGIN_PREFACE;
    fresh->peer_initial_window = H2_DEFAULT_WINDOW;
    fresh->conn_send_window = H2_DEFAULT_WINDOW;
    if (conns.update(key, fresh) != 0) {
        count_error(LLMDIAG_ERR_MAP_FULL);
        return 0;
    }
    return conns.lookup(key);
}

static __always_inline int on_enter(u64 fd, u64 ptr, u64 count, u8 kind, u8 dir)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!watched_pids.lookup(&tgid))
        return 0;
    u32 tid = (u32)id;
    struct h2_call call = {.ptr = ptr, .count = count, .fd = (u32)fd, .kind = kind, .dir = dir};
    if (calls.update(&tid, &call) != 0)
        count_error(LLMDIAG_ERR_MAP_FULL);
    return 0;
}

static __always_inline int on_exit(void *ctx, long ret)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct h2_call *saved = calls.lookup(&tid);
    if (!saved)
        return 0;
    struct h2_call call = *saved;
    calls.delete(&tid);

    struct h2_conn_key key = {.tgid = id >> 32, .fd = call.fd};
    struct h2_conn *conn = conns.lookup(&key);
    if (ret == EAGAIN_RET && call.dir == H2_DIR_SENT && conn) {
        __sync_fetch_and_add(&conn->send_eagain, 1);
        struct h2_stats *stats = stats_for(conn->port, H2_DIR_SENT);
        if (stats)
            __sync_fetch_and_add(&stats->send_eagain, 1);
        return 0;
    }
    if (ret <= 0)
        return 0;
    if (!conn && call.dir == H2_DIR_SENT)
        return 0;
    struct h2_segments *seg = load_segments(&call);
    if (!seg || seg->count == 0)
        return 0;
    if (!conn) {
        conn = adopt_by_preface(&key, seg, ret);
        if (!conn)
            return 0;
    }
    u64 now = bpf_ktime_get_ns();
    u32 skip = 0;
    u8 dir = call.dir;
    if (dir == H2_DIR_RECEIVED && conn->state != H2_STATE_CONFIRMED) {
        int used = match_preface(conn, seg, ret);
        if (used < 0)
            return 0;
        if (used == 0) {
            if (conn->origin == H2_ORIGIN_PREFACE) {
                conns.delete(&key); /* it only looked like a preface */
                return 0;
            }
            conn->state = H2_STATE_UNKNOWN;
            conn->preface_matched = 0;
        } else {
            skip = used;
            if ((u64)used >= (u64)ret)
                return 0;
        }
    }
    struct h2_dir_state *d = dir == H2_DIR_SENT ? &conn->dir[1] : &conn->dir[0];
    seg->tgid = key.tgid;
    seg->fd = key.fd;
    seg->now = now;
    seg->left = ret - skip; /* the bytes of the preface are part of ret but not of the frames */
    seg->off = skip;
    seg->frames = 0;
    seg->rounds = 0;
    seg->dir = dir;
    seg->counting = d->synced && conn->state == H2_STATE_CONFIRMED;
    seg->was_synced = d->synced;
    seg->ok = 1;
    if (d->want < H2_FRAME_HEADER || d->want > H2_PEEK_MAX)
        d->want = H2_FRAME_HEADER;
    walkers.call(ctx, 0);
    count_error(LLMDIAG_ERR_TAIL_CALL); /* only reached when the walker is not installed */
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_write) { return on_enter(args->fd, (u64)args->buf, args->count, H2_CALL_BUF, H2_DIR_SENT); }
TRACEPOINT_PROBE(syscalls, sys_enter_sendto) { return on_enter(args->fd, (u64)args->buff, args->len, H2_CALL_BUF, H2_DIR_SENT); }
TRACEPOINT_PROBE(syscalls, sys_enter_writev) { return on_enter(args->fd, (u64)args->vec, args->vlen, H2_CALL_IOV, H2_DIR_SENT); }
TRACEPOINT_PROBE(syscalls, sys_enter_sendmsg) { return on_enter(args->fd, (u64)args->msg, 0, H2_CALL_MSG, H2_DIR_SENT); }
TRACEPOINT_PROBE(syscalls, sys_enter_read) { return on_enter(args->fd, (u64)args->buf, args->count, H2_CALL_BUF, H2_DIR_RECEIVED); }
TRACEPOINT_PROBE(syscalls, sys_enter_recvfrom) { return on_enter(args->fd, (u64)args->ubuf, args->size, H2_CALL_BUF, H2_DIR_RECEIVED); }
TRACEPOINT_PROBE(syscalls, sys_enter_readv) { return on_enter(args->fd, (u64)args->vec, args->vlen, H2_CALL_IOV, H2_DIR_RECEIVED); }
TRACEPOINT_PROBE(syscalls, sys_enter_recvmsg) { return on_enter(args->fd, (u64)args->msg, 0, H2_CALL_MSG, H2_DIR_RECEIVED); }

TRACEPOINT_PROBE(syscalls, sys_exit_write) { return on_exit(args, args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_sendto) { return on_exit(args, args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_writev) { return on_exit(args, args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_sendmsg) { return on_exit(args, args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_read) { return on_exit(args, args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_recvfrom) { return on_exit(args, args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_readv) { return on_exit(args, args->ret); }
TRACEPOINT_PROBE(syscalls, sys_exit_recvmsg) { return on_exit(args, args->ret); }

/* close(): the fd number may come back as a different connection. */
TRACEPOINT_PROBE(syscalls, sys_enter_close)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!watched_pids.lookup(&tgid))
        return 0;
    struct h2_conn_key key = {.tgid = tgid, .fd = (u32)args->fd};
    conns.delete(&key);
    return 0;
}
