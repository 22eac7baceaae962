/* client_int.h — what the files of the PS client share; not part of client.h.
 *
 * The client is split like ps-lite's app / van / customer:
 *   client.c        the API a trainer calls: options and lifecycle, and every operation
 *                   (register, init, push, pull, pushpull, barrier, heartbeat, stats,
 *                   checkpoint, leave, shutdown) as slots of one ticket; what a reply
 *                   carries back for its operation.
 *   client_conn.c   the transport: one DEALER per server (streams, CURVE, reopening), a
 *                   slot's request on the wire, receiving replies, handshake verdicts, the
 *                   heartbeat thread, the poll round that drives it all.
 *   client_track.c  request tracking: slots and tickets, a reply matched to its slot by
 *                   request id, resends with back-off, re-registration, waiting.
 *
 * A ticket is a user-visible operation; it owns one sub-request ("slot") per message it
 * sends. A slot's request id is (sequence << PS_CLIENT_SLOT_BITS) | slot index, so a reply
 * finds its slot in O(1) and a reply to a slot that has since been reused (a late
 * duplicate) is recognised and dropped. Push frames point into the caller's gradient buffer
 * (zero-copy); frames_out counts the frames zmq still holds, and a slot is only recycled
 * once it is 0.
 *
 * The names below are the client's own: no code outside ps/client*.c calls them.
 */
#ifndef ZPS_PS_CLIENT_INT_H
#define ZPS_PS_CLIENT_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "common/proto.h"
#include "ps/client.h"
#include "ps/shm.h"

#define PS_CLIENT_SLOT_BITS 12
#define PS_CLIENT_SLOTS (1u << PS_CLIENT_SLOT_BITS)
#define PS_CLIENT_TICKETS 4096u

typedef struct ps_client_slot {
    uint64_t rid;         // 0 when free
    int server;
    ps_ticket ticket;     // 0: internal (heartbeat, re-register)
    int op;
    int64_t step;
    uint64_t token;       // the rollback the request belongs to (client.h "Recovery")
    ps_piece *pieces;     // (n_pieces) owned, reused
    size_t n_pieces, cap_pieces;
    const float *src;     // push: flat gradient buffer
    const uint16_t *src16; // push of gradients already bfloat16 (ps_client_push_bf16):
                           // their flat buffer, instead of src
    uint16_t *wire;       // push_dtype bf16: the pieces' gradients converted, back to back
    size_t cap_wire;      // (owned, reused; filled once per slot use, resends send it again)
    int wire_ready;
    int packed;           // Header.packed: one payload frame each way
    float *pack;          // packed f32 push: the pieces' gradients back to back
    size_t cap_pack;      // (owned, reused like wire)
    int pack_ready;
    float *dst;           // pull: flat value buffer
    int shm_data;         // the gradients were staged in the server's segment (its busy bits
    uint64_t shm_nonce;   // are set) ... of this nonce
    int no_shm;           // the server refused them there, or a shared-memory read was torn:
                          // this request's payloads go through ZeroMQ
    int attempts;
    uint64_t deadline_ns; // resend when passed
    uint64_t resend_at_ns; // 0: sent; else the back-off end
    int await_reg;        // waiting for a re-REGISTER of its server
    atomic_int frames_out;
    int done;
} ps_client_slot;

typedef struct ps_client_ticket {
    ps_ticket id;      // 0 when free
    int open;          // slots not finished
    int status;
    int waited;
    uint64_t version;  // min model_version of the replies
    uint64_t done_ns;  // when its last reply was taken (zps_now_ns), 0 before
    char msg[512];
} ps_client_ticket;

struct ps_client {
    ps_client_opts o;
    int n;
    uint32_t trainer;
    void *ctx;
    void **socks;          // (n)
    char **uris;           // (n)
    uint64_t *last_sent_ns; // (n)
    int *reg_inflight;     // (n)
    const ps_plan *plan;
    ps_job req_job;        // what register asked for (re-register repeats it)
    ps_job job;
    int registered;
    ps_client_slot *slots; // (PS_CLIENT_SLOTS)
    uint32_t *free_slots;  // stack
    uint32_t n_free;
    uint64_t seq;
    ps_client_ticket *tickets; // (PS_CLIENT_TICKETS)
    ps_ticket next_ticket;
    ps_piece *pieces;      // scratch for plan pieces
    size_t *next_piece;    // (n) scratch: per-server cursor while cutting messages
    Zps__KeyRange *kr;     // (cap_kr) scratch header ranges, reused by every send
    Zps__KeyRange **krp;
    size_t cap_kr;
    uint64_t last_timeouts_ns; // ps_client_timeouts runs at most every few ms
    size_t cap_pieces;
    zmq_msg_t *frames;     // (PS_MAX_RANGES + 1) receive frames
    char err[512];
    char *stats_json;      // STATS reply captured for ps_client_stats
    Zps__JobConfig *reg_job_reply; // first REGISTER reply's job (owned, unpacked copy)
    ps_optim_config reg_opt;
    int reg_opt_seen, reg_opt_conflict;
    pthread_t hb_thread;   // heartbeat_thread: own sockets, started by register
    int hb_running;
    atomic_int hb_stop;
    int curve;             // the o.curve_* keys are set: every socket is a CURVE client
    void **mons;           // (n) PAIR reading socks[i]'s handshake events; NULL with socks[i]
    unsigned mon_gen;      // keeps monitor endpoints unique across reopened sockets
    int *hs_silent;        // (n) handshakes server i closed without a reason since a success
    char (*refused)[320];  // (n) why server i refused our handshake ("": it has not)
    Zps__Incarnation inc;  // who this client is, sent whole with REGISTER (docs/ps.md
                           // "Trainer identity"); host points into inc_host
    Zps__Incarnation inc_nonce; // inc's nonce alone, sent with every other request
    char inc_host[64];
    /* The live holder a server named when it refused our REGISTER (ZPS_ERR_EXISTS), and the
     * nonce of a holder found dead on this host, sent with the next REGISTER (0: none). */
    struct {
        uint64_t nonce;
        uint32_t pid;
        char host[64];
    } holder;
    uint64_t dead_holder;
    uint64_t deadline_ns;  // ps_client_set_deadline: waits give up then (0: no deadline)
    int *down;             // (n) server i's connection dropped; a handshake brings it back
    uint64_t *incarnation; // (n) the server process last heard from (0: none yet)
    uint64_t rb_token;     // the fleet's newest rollback this client knows (0: none)
    uint64_t rb_version;   // ... and the version it went back to
    int rb_pending;        // sync: a rollback the caller has not done yet (ps_client_rollback)
    uint64_t reconnect_ns; // when a dropped server last came back (0: never)
    /* the same-host data plane (client_shm.c, ps/shm.h), per server */
    ps_shm **shm;          // (n) its segment, mapped (NULL: not on this host, or none offered)
    uint64_t *shm_tried;   // (n) the last segment offered that could not be mapped
    uint64_t **shm_busy;   // (n) bits per element of shm[i]'s slot staged by pushes in flight
    ps_client_answer *answers; // (n) ps_client_admin: each server's answer (NULL otherwise)
    ps_ticket answers_ticket;  // ... to this ticket
};

/* ---- client_conn.c: transport */

/* The header fields every request of c carries: protocol version, trainer id, incarnation
 * (whole on REGISTER, the nonce on the rest). */
void ps_client_header_ident(ps_client *c, Zps__Header *h, int op);
/* A REGISTER refused with ZPS_ERR_EXISTS: keeps the holder the reply names. */
void ps_client_note_holder(ps_client *c, const Zps__Header *h);

/* Opens server i's DEALER (opts.streams connections) and its handshake monitor. */
zps_status ps_client_open_socket(ps_client *c, int i);
/* Closes server i's DEALER, dropping whatever it still holds, and its monitor reader. */
void ps_client_close_socket(ps_client *c, int i);
/* Sends (or resends) slot sl; INIT's optimizer comes from opt. ZPS_ERR_UNAUTHORIZED when
 * the server refused our handshake, ZPS_ERR_ZMQ when the socket is gone or a send fails. */
zps_status ps_client_send_slot(ps_client *c, ps_client_slot *sl, const ps_optim_config *opt);
/* The message for a slot whose send to server failed with st. */
const char *ps_client_send_err(const ps_client *c, int server, zps_status st);
/* Reads every pending handshake verdict of every socket (never blocks). */
void ps_client_handshakes(ps_client *c);
/* One round: poll every socket (up to max_ms), handle replies and timers. */
zps_status ps_client_pump(ps_client *c, int max_ms);
/* Starts the heartbeat thread when the options ask for one and it does not run yet (a
 * warning when it cannot); stops it if it runs. */
void ps_client_hb_start(ps_client *c);
void ps_client_hb_stop(ps_client *c);

/* ---- client_track.c: request tracking */

/* A free slot for op to server as part of ticket t (0: internal); NULL when all are busy. */
ps_client_slot *ps_client_slot_new(ps_client *c, int server, ps_ticket t, int op,
                                   int64_t step);
/* Room for n pieces in sl; sets n_pieces. */
void ps_client_slot_pieces(ps_client_slot *sl, size_t n);
/* Frees a slot after a failure (it may drop and reopen its socket: see client_track.c). */
void ps_client_slot_release(ps_client *c, ps_client_slot *sl);
/* Completes one slot of its ticket: the first failure is the ticket's status and message. */
void ps_client_slot_finish(ps_client *c, ps_client_slot *sl, int status, const char *msg,
                           uint64_t version);
/* Counts sl in its ticket tk and sends it; a failed send finishes the slot at once.
 * Returns the send's status. */
zps_status ps_client_slot_submit(ps_client *c, ps_client_ticket *tk, ps_client_slot *sl,
                                 const ps_optim_config *opt);
/* A new ticket (waits for the oldest one if the ring is full). */
zps_status ps_client_ticket_new(ps_client *c, ps_ticket *out);
/* Ticket t, or NULL when it is unknown or its entry was reused. */
ps_client_ticket *ps_client_ticket_get(ps_client *c, ps_ticket t);
/* Records status and msg unless the ticket already failed. */
void ps_client_ticket_fail(ps_client_ticket *tk, int status, const char *msg);
/* Drives the client until ticket t completed; its status (message in c->err). */
zps_status ps_client_wait_ticket(ps_client *c, ps_ticket t, uint64_t *version,
                                 int mark_waited);
/* Matches a received reply (c->frames[0..nframes)) to its slot and completes it. */
void ps_client_handle_reply(ps_client *c, int server, int nframes);
/* Resends or fails slots whose deadline passed; heartbeats quiet servers. */
void ps_client_timeouts(ps_client *c);
/* Server refused our handshake: fails every request to it. */
void ps_client_fail_server(ps_client *c, int server);
/* Server came back after its connection dropped: sends everything outstanding to it now. */
void ps_client_resend_server(ps_client *c, int server);

/* ---- client_shm.c: the same-host data plane */

/* A reply from server may offer its segment: maps it when this client is on its host. */
void ps_client_shm_offer(ps_client *c, int server, const Zps__Header *h);
/* The segment of server the requests name (Header.shm_nonce; 0: none). */
uint64_t ps_client_shm_nonce(const ps_client *c, int server);
/* A sync push's gradients into this trainer's slot of the server's segment, as f32 (with
 * push_dtype bf16, rounded to bfloat16 first): 1 when staged there (no payload frames then,
 * and f32 ranges), 0 when they go in frames. */
int ps_client_shm_stage(ps_client *c, ps_client_slot *sl);
/* The values of a reply with Header.shm_values into sl->dst: 0, or -1 when they cannot be
 * used (torn, or another segment): the caller asks again through ZeroMQ. */
int ps_client_shm_take(ps_client *c, ps_client_slot *sl, const Zps__Header *h);
/* The slot's staged gradients are no longer read by the server: clears its busy bits. */
void ps_client_shm_done(ps_client *c, ps_client_slot *sl);
void ps_client_shm_free(ps_client *c);

/* ---- client.c: the operations */

/* What an OK reply h to slot sl carries for its op (the REGISTER job and optimizer, STATS
 * JSON, pulled values from c->frames[1..nframes)). ZPS_OK, or ZPS_ERR_FRAMES with *msg set
 * when the pulled frames do not match the request. */
int ps_client_take_reply(ps_client *c, ps_client_slot *sl, const Zps__Header *h, int nframes,
                         const char **msg);

#endif
