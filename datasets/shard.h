/* shard.h — LMDB shards: the writer, the per-shard reader and a dataset (a set of shards).
 *
 * Layout (docs/datasets.md): a dataset is a directory holding N shards named
 * NAME-SSSSS-of-NNNNN (S = 0..N-1, five digits each). Each shard is an LMDB environment
 * directory (data.mdb, lock.mdb) with one unnamed database whose keys are the record's local
 * index in that shard as 10 decimal digits ("0000000042") and whose values are packed
 * Example protobufs (record.h). Keys are dense: a shard with C records has keys 0..C-1.
 * An optional classes.txt beside the shards holds one class name per line; its line count
 * bounds labels.
 *
 * The writer spreads records round-robin (record g goes to shard g mod N, as key g div N), so
 * shard sizes differ by at most one and every shard holds a mix of classes. Writes are
 * buffered and committed in large transactions; the LMDB map is grown when it fills.
 *
 * Readers open shards read-only without a lock file (MDB_RDONLY | MDB_NOLOCK | MDB_NOTLS), so
 * any number of threads may each hold a ds_reader on the same shard; a dataset must not be
 * written while it is being read. A shard whose data file is shorter than LMDB's last page
 * says is reported as truncated at open instead of faulting later.
 */
#ifndef ZPS_DATASETS_SHARD_H
#define ZPS_DATASETS_SHARD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "datasets/record.h"

#define DS_KEY_LEN 10 // digits in a record key
#define DS_MAX_SHARDS 99999

/* ---- writer ---- */

typedef struct ds_writer ds_writer;

/* Creates dir (and parents) and N empty shards, written as hidden dir/.NAME-SSSSS-of-NNNNN.tmp
 * and renamed to dir/NAME-SSSSS-of-NNNNN by ds_writer_close once complete, so an interrupted
 * conversion never looks like a dataset. An existing shard of that name is ZPS_ERR_EXISTS
 * unless overwrite, which deletes every NAME-*-of-* shard in dir first. */
zps_status ds_writer_new(const char *dir, const char *name, int n_shards, bool overwrite,
                         ds_writer **out);
/* Validates, packs and buffers one record (bytes are copied). */
zps_status ds_writer_put(ds_writer *w, const ds_record *r);
/* Records written so far. */
uint64_t ds_writer_count(const ds_writer *w);
/* Commits everything, syncs, renames the shards into place and frees the writer
 * (*pw = NULL) whatever the outcome. */
zps_status ds_writer_close(ds_writer **pw);
/* Frees without committing, deleting the unfinished shards (after an error). Safe on NULL. */
void ds_writer_destroy(ds_writer **pw);

/* ---- one shard ---- */

typedef struct ds_shard ds_shard;

/* Flags for ds_shard_open / ds_dataset_open_flags. */
enum {
    /* A truncated shard opens "damaged" instead of failing: its record count comes from the
     * LMDB meta page (which survives truncation at the end), and every read of one of its
     * records fails with ZPS_ERR_CORRUPT naming shard and key. Used with skip_corrupt, so the
     * records are skipped and counted one by one. */
    DS_OPEN_ALLOW_DAMAGED = 1u << 0,
};

/* Opens the shard directory read-only. ZPS_ERR_NOT_FOUND when it has no data.mdb,
 * ZPS_ERR_CORRUPT when it is not an LMDB file, or when it is truncated and flags lack
 * DS_OPEN_ALLOW_DAMAGED (the error names the shard). */
zps_status ds_shard_open(const char *path, unsigned flags, ds_shard **out);
/* Non-NULL reason ("truncated: ...") when the shard opened damaged; NULL when healthy. */
const char *ds_shard_damage(const ds_shard *s);
void ds_shard_close(ds_shard **ps);
uint64_t ds_shard_count(const ds_shard *s);
/* Directory name, e.g. "train-00001-of-00004". */
const char *ds_shard_name(const ds_shard *s);
const char *ds_shard_path(const ds_shard *s);

/* A read transaction + cursor on one shard, for one thread at a time. Values returned are
 * pointers into the map, valid until the reader is closed. */
typedef struct ds_reader ds_reader;
zps_status ds_reader_new(ds_shard *s, ds_reader **out);
void ds_reader_destroy(ds_reader **pr);
/* Value of the record with local index idx. ZPS_ERR_CORRUPT (logged with shard and key) when
 * the key is missing although idx < count, or the shard is damaged. */
zps_status ds_reader_get(ds_reader *r, uint64_t idx, const uint8_t **val, size_t *len);
/* Cursor iteration in key order: first call after new/rewind gives the first record.
 * ZPS_ERR_EOF after the last. key receives the key text (DS_KEY_LEN + 1 bytes). */
zps_status ds_reader_next(ds_reader *r, char *key, const uint8_t **val, size_t *len);
void ds_reader_rewind(ds_reader *r);

/* The key text of local index idx into key (DS_KEY_LEN + 1 bytes). */
void ds_key_format(uint64_t idx, char *key);

/* ---- dataset ---- */

typedef struct ds_dataset {
    char dir[4096];      // directory holding the shards
    char name[256];      // NAME part of the shard names
    int n_shards;
    ds_shard **shards;   // (n_shards) in shard-index order
    uint64_t *offsets;   // (n_shards + 1) global index of each shard's first record
    uint64_t total;      // records in all shards
    int num_classes;     // lines of classes.txt, 0 when absent
    char **classes;      // (num_classes) names, or NULL
} ds_dataset;

/* Opens the shards at path: a directory holding NAME-SSSSS-of-NNNNN shards (one NAME), or a
 * prefix DIR/NAME. When split is not NULL and path/split is a directory, that is used (so
 * "DIR" + "train" finds DIR/train). ZPS_ERR_NOT_FOUND names what is missing (no shards, or a
 * shard index absent from 0..N-1), ZPS_ERR_CORRUPT a damaged shard. */
zps_status ds_dataset_open(const char *path, const char *split, ds_dataset **out);
/* ds_dataset_open with DS_OPEN_* flags for every shard. */
zps_status ds_dataset_open_flags(const char *path, const char *split, unsigned flags,
                                 ds_dataset **out);
void ds_dataset_close(ds_dataset **pd);
/* Shard and local index of global record g (< total). */
void ds_dataset_locate(const ds_dataset *d, uint64_t g, int *shard, uint64_t *local);

/* The documented trainer assignment: trainer i of n gets global records
 * [floor(i * total / n), floor((i + 1) * total / n)) — disjoint, covering, sizes within one. */
void ds_assign(uint64_t total, int i, int n, uint64_t *begin, uint64_t *end);

/* Writes names (one per line) to dir/classes.txt. */
zps_status ds_classes_write(const char *dir, char *const *names, int n);

#endif
