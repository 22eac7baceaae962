/* image.c — see image.h. libturbojpeg reports warnings (e.g. "premature end of JPEG file" on
 * a truncated payload) as failures of tjDecompress2, which is what we want: a truncated image
 * is corrupt. libpng is used through its simplified API. */
#include "datasets/image.h"

#include <assert.h>
#include <math.h>
#include <png.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <turbojpeg.h>

#include "common/log.h"
#include "common/mem.h"

/* Largest output width of ds_image_sample (per-column tables live on the stack). */
#define S_MAX_OUT_W 4096

struct ds_codec {
    tjhandle dec;    // turbojpeg decompressor
    tjhandle enc;    // turbojpeg compressor, created on first encode
    uint8_t *pix;    // decoded pixels, capacity pix_cap
    size_t pix_cap;
    uint8_t *out;    // encoded bytes, capacity out_cap
    size_t out_cap;
};

ds_codec *ds_codec_new(void)
{
    tjhandle dec = tjInitDecompress();
    if (!dec) {
        zps_log(ZPS_ERROR, "ds", "tjInitDecompress failed: %s", tjGetErrorStr2(NULL));
        return NULL;
    }
    ds_codec *c = zps_xcalloc(1, sizeof *c);
    c->dec = dec;
    return c;
}

void ds_codec_destroy(ds_codec **pc)
{
    if (!pc || !*pc)
        return;
    ds_codec *c = *pc;
    tjDestroy(c->dec);
    if (c->enc)
        tjDestroy(c->enc);
    free(c->pix);
    free(c->out);
    free(c);
    *pc = NULL;
}

static uint8_t *s_reserve(uint8_t **buf, size_t *cap, size_t n)
{
    if (n > *cap) {
        free(*buf);
        *buf = zps_xmalloc(n);
        *cap = n;
    }
    return *buf;
}

static bool s_is_png(const uint8_t *b, size_t n)
{
    static const uint8_t sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    return n >= 8 && memcmp(b, sig, 8) == 0;
}

static bool s_is_jpeg(const uint8_t *b, size_t n) { return n >= 3 && b[0] == 0xff && b[1] == 0xd8; }

static zps_status s_jpeg_header(ds_codec *c, const uint8_t *b, size_t n, int *h, int *w,
                                int *ch, char *why, size_t why_len)
{
    int subsamp, cs;
    if (n > (size_t)0xffffffffu ||
        tjDecompressHeader3(c->dec, b, (unsigned long)n, w, h, &subsamp, &cs) != 0) {
        if (why)
            snprintf(why, why_len, "bad JPEG header: %s", tjGetErrorStr2(c->dec));
        return ZPS_ERR_DECODE;
    }
    *ch = cs == TJCS_GRAY ? 1 : 3;
    return ZPS_OK;
}

static zps_status s_jpeg_decode(ds_codec *c, const uint8_t *b, size_t n, int h, int w, int ch,
                                char *why, size_t why_len)
{
    s_reserve(&c->pix, &c->pix_cap, (size_t)h * w * ch);
    if (tjDecompress2(c->dec, b, (unsigned long)n, c->pix, w, 0, h,
                      ch == 1 ? TJPF_GRAY : TJPF_RGB, 0) != 0) {
        if (why)
            snprintf(why, why_len, "JPEG decode failed: %s", tjGetErrorStr2(c->dec));
        return ZPS_ERR_DECODE;
    }
    return ZPS_OK;
}

static zps_status s_png_begin(png_image *im, const uint8_t *b, size_t n, char *why,
                              size_t why_len)
{
    memset(im, 0, sizeof *im);
    im->version = PNG_IMAGE_VERSION;
    if (!png_image_begin_read_from_memory(im, b, n)) {
        if (why)
            snprintf(why, why_len, "bad PNG header: %s", im->message);
        png_image_free(im);
        return ZPS_ERR_DECODE;
    }
    return ZPS_OK;
}

static zps_status s_png_finish(ds_codec *c, png_image *im, int ch, char *why, size_t why_len)
{
    im->format = ch == 1 ? PNG_FORMAT_GRAY : PNG_FORMAT_RGB;
    s_reserve(&c->pix, &c->pix_cap, (size_t)im->height * im->width * ch);
    if (!png_image_finish_read(im, NULL, c->pix, 0, NULL)) {
        if (why)
            snprintf(why, why_len, "PNG decode failed: %s", im->message);
        png_image_free(im);
        return ZPS_ERR_DECODE;
    }
    png_image_free(im);
    return ZPS_OK;
}

zps_status ds_image_decode(ds_codec *c, const ds_record *r, ds_pixels *out, char *why,
                           size_t why_len)
{
    int h = 0, w = 0, ch = 0;
    out->h = (int)r->height;
    out->w = (int)r->width;
    out->c = (int)r->channels;
    switch (r->encoding) {
    case DS_ENC_RAW:
        out->px = r->image;
        return ZPS_OK;
    case DS_ENC_JPEG: {
        zps_status st = s_jpeg_header(c, r->image, r->image_len, &h, &w, &ch, why, why_len);
        if (st != ZPS_OK)
            return st;
        if (h != out->h || w != out->w) {
            if (why)
                snprintf(why, why_len, "JPEG is %dx%d, record says %dx%d", w, h, out->w, out->h);
            return ZPS_ERR_DECODE;
        }
        st = s_jpeg_decode(c, r->image, r->image_len, h, w, out->c, why, why_len);
        out->px = c->pix;
        return st;
    }
    case DS_ENC_PNG: {
        png_image im;
        zps_status st = s_png_begin(&im, r->image, r->image_len, why, why_len);
        if (st != ZPS_OK)
            return st;
        if ((int)im.height != out->h || (int)im.width != out->w) {
            if (why)
                snprintf(why, why_len, "PNG is %ux%u, record says %dx%d", im.width, im.height,
                         out->w, out->h);
            png_image_free(&im);
            return ZPS_ERR_DECODE;
        }
        st = s_png_finish(c, &im, out->c, why, why_len);
        out->px = c->pix;
        return st;
    }
    }
    if (why)
        snprintf(why, why_len, "unknown encoding %d", (int)r->encoding);
    return ZPS_ERR_DECODE;
}

zps_status ds_image_probe(ds_codec *c, const uint8_t *bytes, size_t len, ds_encoding *enc,
                          int *h, int *w, int *ch)
{
    char why[256];
    if (s_is_jpeg(bytes, len)) {
        *enc = DS_ENC_JPEG;
        zps_status st = s_jpeg_header(c, bytes, len, h, w, ch, why, sizeof why);
        if (st != ZPS_OK)
            zps_log(ZPS_DEBUG, "ds", "%s", why);
        return st;
    }
    if (s_is_png(bytes, len)) {
        png_image im;
        *enc = DS_ENC_PNG;
        zps_status st = s_png_begin(&im, bytes, len, why, sizeof why);
        if (st != ZPS_OK) {
            zps_log(ZPS_DEBUG, "ds", "%s", why);
            return st;
        }
        *h = (int)im.height;
        *w = (int)im.width;
        *ch = (im.format & PNG_FORMAT_FLAG_COLOR) ? 3 : 1;
        png_image_free(&im);
        return ZPS_OK;
    }
    return ZPS_ERR_UNSUPPORTED;
}

zps_status ds_image_decode_any(ds_codec *c, const uint8_t *bytes, size_t len, ds_pixels *out,
                               ds_encoding *enc)
{
    int h, w, ch;
    zps_status st = ds_image_probe(c, bytes, len, enc, &h, &w, &ch);
    if (st != ZPS_OK)
        return st;
    if (h < 1 || w < 1 || h > DS_MAX_DIM || w > DS_MAX_DIM)
        return ZPS_ERR_DECODE;
    ds_record r = {.image = bytes, .image_len = len, .encoding = *enc, .height = (uint32_t)h,
                   .width = (uint32_t)w, .channels = (uint32_t)ch};
    char why[256];
    st = ds_image_decode(c, &r, out, why, sizeof why);
    if (st != ZPS_OK)
        zps_log(ZPS_DEBUG, "ds", "%s", why);
    return st;
}

zps_status ds_image_encode(ds_codec *c, const uint8_t *px, int h, int w, int ch,
                           ds_encoding enc, int quality, const uint8_t **out, size_t *len)
{
    assert(ch == 1 || ch == 3);
    if (enc == DS_ENC_JPEG) {
        if (!c->enc) {
            c->enc = tjInitCompress();
            if (!c->enc) {
                zps_log(ZPS_ERROR, "ds", "tjInitCompress failed: %s", tjGetErrorStr2(NULL));
                return ZPS_ERR_INTERNAL;
            }
        }
        int ss = ch == 1 ? TJSAMP_GRAY : quality >= 90 ? TJSAMP_444 : TJSAMP_420;
        unsigned long cap = tjBufSize(w, h, ss);
        s_reserve(&c->out, &c->out_cap, cap);
        unsigned char *dst = c->out;
        unsigned long n = c->out_cap;
        if (tjCompress2(c->enc, px, w, 0, h, ch == 1 ? TJPF_GRAY : TJPF_RGB, &dst, &n, ss,
                        quality, TJFLAG_NOREALLOC) != 0) {
            zps_log(ZPS_ERROR, "ds", "JPEG encode failed: %s", tjGetErrorStr2(c->enc));
            return ZPS_ERR_INTERNAL;
        }
        *out = c->out;
        *len = n;
        return ZPS_OK;
    }
    if (enc == DS_ENC_PNG) {
        png_image im;
        memset(&im, 0, sizeof im);
        im.version = PNG_IMAGE_VERSION;
        im.width = (png_uint_32)w;
        im.height = (png_uint_32)h;
        im.format = ch == 1 ? PNG_FORMAT_GRAY : PNG_FORMAT_RGB;
        png_alloc_size_t n = 0;
        if (!png_image_write_get_memory_size(im, n, 0, px, 0, NULL)) {
            zps_log(ZPS_ERROR, "ds", "PNG size query failed: %s", im.message);
            png_image_free(&im);
            return ZPS_ERR_INTERNAL;
        }
        s_reserve(&c->out, &c->out_cap, n);
        n = c->out_cap;
        if (!png_image_write_to_memory(&im, c->out, &n, 0, px, 0, NULL)) {
            zps_log(ZPS_ERROR, "ds", "PNG encode failed: %s", im.message);
            png_image_free(&im);
            return ZPS_ERR_INTERNAL;
        }
        png_image_free(&im);
        *out = c->out;
        *len = n;
        return ZPS_OK;
    }
    *out = px;
    *len = (size_t)h * w * ch;
    return ZPS_OK;
}

/* Source coordinate of output index o for a crop starting at a of length len sampled to n
 * outputs, split into the two neighbours and the weight of the second. */
static void s_coord(float a, float len, int n, int o, int limit, int *i0, int *i1, float *f)
{
    float s = a + ((float)o + 0.5f) * len / (float)n - 0.5f;
    if (s < 0.f)
        s = 0.f;
    if (s > (float)(limit - 1))
        s = (float)(limit - 1);
    int i = (int)s;
    *i0 = i;
    *i1 = i + 1 < limit ? i + 1 : i;
    *f = s - (float)i;
}

void ds_resize_u8(const uint8_t *src, int sh, int sw, int c, uint8_t *dst, int dh, int dw)
{
    for (int y = 0; y < dh; y++) {
        int y0, y1;
        float fy;
        s_coord(0.f, (float)sh, dh, y, sh, &y0, &y1, &fy);
        for (int x = 0; x < dw; x++) {
            int x0, x1;
            float fx;
            s_coord(0.f, (float)sw, dw, x, sw, &x0, &x1, &fx);
            for (int k = 0; k < c; k++) {
                float a = src[((size_t)y0 * sw + x0) * c + k], b = src[((size_t)y0 * sw + x1) * c + k];
                float d = src[((size_t)y1 * sw + x0) * c + k], e = src[((size_t)y1 * sw + x1) * c + k];
                float top = a + (b - a) * fx, bot = d + (e - d) * fx;
                float v = top + (bot - top) * fy;
                dst[((size_t)y * dw + x) * c + k] = (uint8_t)(v + 0.5f);
            }
        }
    }
}

/* One source row interpolated horizontally at the output columns' taps: out (ow * sc). */
static void s_row_lerp(const uint8_t *row, int sc, int ow, const int *xa, const int *xb,
                       const float *fxs, float *out)
{
    if (sc == 1) {
        for (int x = 0; x < ow; x++) {
            float a = row[xa[x]], b = row[xb[x]];
            out[x] = a + (b - a) * fxs[x];
        }
        return;
    }
    for (int x = 0; x < ow; x++) {
        const uint8_t *a = row + xa[x], *b = row + xb[x];
        const float f = fxs[x];
        out[3 * x] = a[0] + (b[0] - a[0]) * f;
        out[3 * x + 1] = a[1] + (b[1] - a[1]) * f;
        out[3 * x + 2] = a[2] + (b[2] - a[2]) * f;
    }
}

/* One interpolated row (ow, sc) normalised into output row d of the oc channel planes: the
 * same channels, gray copied to three, or RGB to gray. */
static void s_row_store(const float *ra, int sc, int oc, int ow, size_t plane,
                        const float *scale, const float *bias, float *d)
{
    if (sc == oc) {
        for (int k = 0; k < oc; k++) {
            float *dk = d + k * plane;
            const float sk = scale[k], bk = bias[k];
            for (int x = 0; x < ow; x++)
                dk[x] = ra[x * sc + k] * sk + bk;
        }
    } else if (sc == 1) {
        for (int k = 0; k < 3; k++) {
            float *dk = d + k * plane;
            const float sk = scale[k], bk = bias[k];
            for (int x = 0; x < ow; x++)
                dk[x] = ra[x] * sk + bk;
        }
    } else {
        for (int x = 0; x < ow; x++) {
            float g = 0.299f * ra[3 * x] + 0.587f * ra[3 * x + 1] + 0.114f * ra[3 * x + 2];
            d[x] = g * scale[0] + bias[0];
        }
    }
}

void ds_image_sample(const ds_pixels *src, const ds_crop *crop, int oh, int ow, int oc,
                     const float *mean, const float *std, float *dst)
{
    assert(ow >= 1 && ow <= S_MAX_OUT_W && oh >= 1);
    assert(oc == 1 || oc == 3);
    /* Separable: each output row interpolates its two source rows horizontally (tables
     * computed once per call), then blends them vertically while normalising into the
     * channel planes. */
    int xa[S_MAX_OUT_W], xb[S_MAX_OUT_W];
    float fxs[S_MAX_OUT_W];
    float ra[S_MAX_OUT_W * 3], rb[S_MAX_OUT_W * 3];
    const int sc = src->c, sw = src->w;
    for (int x = 0; x < ow; x++) {
        int xo = crop->flip ? ow - 1 - x : x;
        int i0, i1;
        float f;
        s_coord(crop->x0, crop->w, ow, xo, src->w, &i0, &i1, &f);
        xa[x] = i0 * sc;
        xb[x] = i1 * sc;
        fxs[x] = f;
    }
    float scale[3], bias[3];
    for (int k = 0; k < oc; k++) {
        scale[k] = 1.f / (255.f * std[k]);
        bias[k] = -mean[k] / std[k];
    }
    const size_t plane = (size_t)oh * ow;
    for (int y = 0; y < oh; y++) {
        int y0, y1;
        float fy;
        s_coord(crop->y0, crop->h, oh, y, src->h, &y0, &y1, &fy);
        const bool two = fy > 0.f && y1 != y0;
        s_row_lerp(src->px + (size_t)y0 * sw * sc, sc, ow, xa, xb, fxs, ra);
        if (two) {
            s_row_lerp(src->px + (size_t)y1 * sw * sc, sc, ow, xa, xb, fxs, rb);
            for (int i = 0; i < ow * sc; i++)
                ra[i] += (rb[i] - ra[i]) * fy;
        }
        s_row_store(ra, sc, oc, ow, plane, scale, bias, dst + (size_t)y * ow);
    }
}
