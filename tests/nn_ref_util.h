/* nn_ref_util.h — helpers for the tests that compare a zps model with a PyTorch float64
 * reference (tests/ref/inception_ref.py, ssd_ref.py; testutil.h writes their inputs and runs
 * them): reading the runs' outputs and the per-tensor bound of tests/test_nn_inception.c:
 *     err_zps <= 1e-3 + 4 * max(err_f32, err_pert...)
 * each err_* a relative L2 error against the float64 truth (ref[0]); ref[1] is PyTorch's
 * float32 run and ref[2..nref) its float32 runs on perturbed inputs. */
#ifndef ZPS_TESTS_NN_REF_UTIL_H
#define ZPS_TESTS_NN_REF_UTIL_H

#include <stddef.h>

/* Relative L2 error of a (float) or b (double) against ref (double). */
double nrt_rel(const float *a, const double *b, const double *ref, size_t n);
/* ref[0] = dir/ref.f64, ref[1] = dir/ref.f32, ref[2 + k] = dir/ref.pert<k>, each of total
 * values; nref entries in all. */
void nrt_read_refs(const char *dir, size_t total, double **ref, int nref);

/* The comparison's running tally over the tensors. */
typedef struct nrt_tally {
    int bad, tight, torch_tight, checked;
    double worst;
    const char *worst_name;
    int verbose;
    int nref; // entries of ref
} nrt_tally;

/* One tensor of cnt values at off in the reference files, against the bound above; a miss
 * counts in ty->bad and is printed by name. */
void nrt_check_tensor(const char *name, const float *mine, double *const *ref, size_t off,
                      size_t cnt, nrt_tally *ty);

#endif
