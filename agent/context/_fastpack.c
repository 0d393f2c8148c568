/* The full pack's hot loop in C: read files, decide the common cases, render their sections.
 *
 * An optional accelerator of agent/context/reader.py: when this module is not built, the reader
 * does the same work in Python, and the tests hold the two to the same bytes and records.
 *
 * scan() takes plain files (a name with nothing to quote, a known git blob id, no cached facts)
 * and, on a few threads without the GIL, applies the default path rules and reads each one. A
 * file is decided here only when the answer is simple: excluded by its path; binary (a NUL, read
 * whole); or text that is valid UTF-8 with no control byte up front, no generated marker, no
 * backtick fence of its own and not possibly minified, whose section is rendered into the
 * caller's memory. Anything else (large, unreadable, other encodings, ...) is left to Python.
 * Every rule's data (names, suffixes, markers, probe lengths) comes from Python's constants via
 * configure(), so the rules are written down once.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_THREADS 8
#define CHUNK 64

enum { ST_PATH = 0, ST_BINARY = 1, ST_GENERAL = 2, ST_PACKED = 3, ST_EXCLUDED = 4, ST_TOO_LARGE = 5 };

typedef struct {
    char **items;
    size_t *lens;
    Py_ssize_t n;
} strlist;

static struct {
    int ready;
    strlist vendored, gendirs, lockfiles, minified, sourcemap, gensuffix, markers, minifiable;
    unsigned char control[256];
    Py_ssize_t marker_probe, control_probe, minified_min, minified_probe, first_read;
    double minified_avg_line;
    char *note;
    size_t note_len;
} cfg;

typedef struct {
    int status, code, newline, region;
    Py_ssize_t size, chars, lines, start, mid, stop, end;
} record;

typedef struct {
    char *base;
    Py_ssize_t size, cur;
    int full;
} region_t;

typedef struct {
    int rootfd;
    Py_ssize_t limit, count;
    const char **paths;
    const Py_ssize_t *path_lens;
    record *recs;
    region_t *regions;
    Py_ssize_t next;  /* the next chunk to claim (atomic) */
} job_t;

typedef struct {
    job_t *job;
    int index;
} worker_t;

static void strlist_free(strlist *l) {
    for (Py_ssize_t i = 0; i < l->n; i++) PyMem_RawFree(l->items[i]);
    PyMem_RawFree(l->items);
    PyMem_RawFree(l->lens);
    l->items = NULL;
    l->lens = NULL;
    l->n = 0;
}

static int strlist_set(strlist *l, PyObject *seq, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    strlist_free(l);
    l->items = PyMem_RawCalloc(n ? n : 1, sizeof(char *));
    l->lens = PyMem_RawCalloc(n ? n : 1, sizeof(size_t));
    if (!l->items || !l->lens) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        char *s;
        Py_ssize_t len;
        if (PyBytes_AsStringAndSize(PySequence_Fast_GET_ITEM(fast, i), &s, &len) < 0) {
            Py_DECREF(fast);
            return -1;
        }
        l->items[i] = PyMem_RawMalloc(len + 1);
        if (!l->items[i]) {
            Py_DECREF(fast);
            PyErr_NoMemory();
            return -1;
        }
        memcpy(l->items[i], s, len);
        l->items[i][len] = 0;
        l->lens[i] = (size_t)len;
        l->n = i + 1;
    }
    Py_DECREF(fast);
    return 0;
}

static PyObject *configure(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"vendored", "generated_dirs", "lockfiles", "minified", "source_maps", "generated",
                            "markers", "minifiable", "controls", "marker_probe", "control_probe",
                            "minified_min", "minified_probe", "minified_avg_line", "first_read", "no_newline_note", NULL};
    PyObject *vendored, *gendirs, *lockfiles, *minified, *sourcemap, *gensuffix, *markers, *minifiable;
    Py_buffer controls, note;
    Py_ssize_t marker_probe, control_probe, minified_min, minified_probe, first_read;
    double minified_avg_line;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOOy*nnnndny*", names, &vendored, &gendirs, &lockfiles,
                                     &minified, &sourcemap, &gensuffix, &markers, &minifiable, &controls,
                                     &marker_probe, &control_probe, &minified_min, &minified_probe,
                                     &minified_avg_line, &first_read, &note))
        return NULL;
    cfg.ready = 0;
    int bad = strlist_set(&cfg.vendored, vendored, "vendored") || strlist_set(&cfg.gendirs, gendirs, "generated_dirs")
              || strlist_set(&cfg.lockfiles, lockfiles, "lockfiles") || strlist_set(&cfg.minified, minified, "minified")
              || strlist_set(&cfg.sourcemap, sourcemap, "source_maps")
              || strlist_set(&cfg.gensuffix, gensuffix, "generated") || strlist_set(&cfg.markers, markers, "markers")
              || strlist_set(&cfg.minifiable, minifiable, "minifiable");
    if (!bad) {
        memset(cfg.control, 0, sizeof cfg.control);
        for (Py_ssize_t i = 0; i < controls.len; i++) cfg.control[((unsigned char *)controls.buf)[i]] = 1;
        cfg.marker_probe = marker_probe;
        cfg.control_probe = control_probe;
        cfg.minified_min = minified_min;
        cfg.minified_probe = minified_probe;
        cfg.minified_avg_line = minified_avg_line;
        cfg.first_read = first_read;
        PyMem_RawFree(cfg.note);
        cfg.note = PyMem_RawMalloc(note.len + 1);
        if (!cfg.note) {
            PyErr_NoMemory();
            bad = 1;
        } else {
            memcpy(cfg.note, note.buf, note.len);
            cfg.note_len = (size_t)note.len;
            cfg.ready = 1;
        }
    }
    PyBuffer_Release(&controls);
    PyBuffer_Release(&note);
    if (bad) return NULL;
    Py_RETURN_NONE;
}

/* ---- path rules (selection.path_reason) ---- */

static int in_list(const strlist *l, const char *s, size_t len) {
    for (Py_ssize_t i = 0; i < l->n; i++)
        if (l->lens[i] == len && memcmp(l->items[i], s, len) == 0) return 1;
    return 0;
}

static int ends_with_any(const strlist *l, const char *s, size_t len) {
    for (Py_ssize_t i = 0; i < l->n; i++)
        if (l->lens[i] <= len && memcmp(s + len - l->lens[i], l->items[i], l->lens[i]) == 0) return 1;
    return 0;
}

/* 0: none; 1 vendored, 2 generated, 3 lockfile, 4 minified, 5 source-map (the order Python checks).
 * `lower` is the path's file name lowercased (ASCII: these paths are plain ASCII). */
static int path_code(const char *path, size_t len, const char *lower, size_t name_at) {
    int generated_dir = 0;
    if (name_at) {
        size_t start = 0;
        for (size_t i = 0; i < name_at; i++) {
            if (path[i] != '/') continue;
            const char *part = path + start;
            size_t plen = i - start;
            if (in_list(&cfg.vendored, part, plen)) return 1;
            if (in_list(&cfg.gendirs, part, plen)) generated_dir = 1;
            if (plen >= 9 && memcmp(part + plen - 9, ".egg-info", 9) == 0) generated_dir = 1;
            start = i + 1;
        }
    }
    if (generated_dir) return 2;
    const char *name = path + name_at;
    size_t nlen = len - name_at;
    if (in_list(&cfg.lockfiles, name, nlen)) return 3;
    if (ends_with_any(&cfg.minified, lower, nlen)) return 4;
    if (ends_with_any(&cfg.sourcemap, lower, nlen)) return 5;
    if (ends_with_any(&cfg.gensuffix, lower, nlen)) return 2;
    return 0;
}

/* ---- content checks (selection.decode, layout.fence_for) ---- */

#define ONES 0x0101010101010101ULL
#define HIGHS 0x8080808080808080ULL
#define HAS_ZERO(v) (((v) - ONES) & ~(v) & HIGHS)

/* Strict UTF-8 (what Python's decoder accepts) with no NUL: the number of characters; -1 when the
 * text is not valid UTF-8 (a NUL may still follow), -2 when it holds a NUL. ASCII goes 32 bytes at
 * a time, looking for NULs as it goes. */
static Py_ssize_t utf8_chars(const unsigned char *s, Py_ssize_t n) {
    Py_ssize_t i = 0, chars = 0;
    while (i < n) {
        if (i + 32 <= n) {
            uint64_t w0, w1, w2, w3;
            memcpy(&w0, s + i, 8);
            memcpy(&w1, s + i + 8, 8);
            memcpy(&w2, s + i + 16, 8);
            memcpy(&w3, s + i + 24, 8);
            if (!((w0 | w1 | w2 | w3) & HIGHS)) {
                if (HAS_ZERO(w0) | HAS_ZERO(w1) | HAS_ZERO(w2) | HAS_ZERO(w3)) return -2;
                i += 32;
                chars += 32;
                continue;
            }
        }
        unsigned char c = s[i];
        if (c < 0x80) {
            if (c == 0) return -2;
            i++;
        } else if (c >= 0xC2 && c <= 0xDF) {
            if (i + 1 >= n || (s[i + 1] & 0xC0) != 0x80) return -1;
            i += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (i + 2 >= n) return -1;
            unsigned char c1 = s[i + 1];
            if ((c1 & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80) return -1;
            if (c == 0xE0 && c1 < 0xA0) return -1;  /* overlong */
            if (c == 0xED && c1 > 0x9F) return -1;  /* surrogate */
            i += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (i + 3 >= n) return -1;
            unsigned char c1 = s[i + 1];
            if ((c1 & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80 || (s[i + 3] & 0xC0) != 0x80) return -1;
            if (c == 0xF0 && c1 < 0x90) return -1;  /* overlong */
            if (c == 0xF4 && c1 > 0x8F) return -1;  /* past U+10FFFF */
            i += 4;
        } else {
            return -1;
        }
        chars++;
    }
    return chars;
}

static int has_triple_backtick(const char *s, Py_ssize_t n) {
    const char *p = s, *end = s + n;
    while (p < end && (p = memchr(p, '`', (size_t)(end - p))) != NULL) {
        if (end - p >= 3 && p[1] == '`' && p[2] == '`') return 1;
        p++;
    }
    return 0;
}

static Py_ssize_t count_newlines(const char *s, Py_ssize_t n) {
    Py_ssize_t lines = 0, i = 0;
    for (; i + 8 <= n; i += 8) { /* a word at a time: its bytes equal to '\n' */
        uint64_t w;
        memcpy(&w, s + i, 8);
        uint64_t x = w ^ (ONES * '\n');
        uint64_t nonzero = (((x & ~HIGHS) + ~HIGHS) | x) & HIGHS;
        lines += 8 - (Py_ssize_t)(((nonzero >> 7) * ONES) >> 56);
    }
    for (; i < n; i++) lines += s[i] == '\n';
    return lines;
}

/* layout.language for a plain ASCII path: the extension lowercased when it is 1 to 10 letters or
 * digits, after a name that is not only dots. */
static size_t language(const char *path, size_t len, size_t name_at, char *out) {
    const char *dot = NULL;
    for (size_t i = len; i > name_at; i--)
        if (path[i - 1] == '.') {
            dot = path + i - 1;
            break;
        }
    if (!dot) return 0;
    int stem = 0;
    for (const char *p = path + name_at; p < dot; p++)
        if (*p != '.') stem = 1;
    if (!stem) return 0;
    size_t elen = len - (size_t)(dot + 1 - path);
    if (elen == 0 || elen > 10) return 0;
    for (size_t i = 0; i < elen; i++) {
        unsigned char c = (unsigned char)dot[1 + i];
        if (c >= 'A' && c <= 'Z') c = (unsigned char)(c - 'A' + 'a');
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'))) return 0;
        out[i] = (char)c;
    }
    return elen;
}

/* Read a whole file (as reader.read_bytes does) into `dst`, which has room for limit + 1 bytes: its
 * size, or -1 on an error (left to Python), or -2 when it is over `limit` (*size_out: its size). */
static Py_ssize_t read_file(int fd, char *dst, Py_ssize_t limit, Py_ssize_t *size_out) {
    Py_ssize_t want = cfg.first_read < limit + 1 ? cfg.first_read : limit + 1;
    ssize_t got;
    do {
        got = read(fd, dst, (size_t)want);
    } while (got < 0 && errno == EINTR);
    if (got < 0) return -1;
    struct stat st;
    if (got < cfg.first_read) {  /* a short read of a regular file is its end */
        if (got <= limit) return got;
        if (fstat(fd, &st) < 0) return -1;
        *size_out = st.st_size;
        return -2;
    }
    Py_ssize_t total = got;
    while (total <= limit) {
        Py_ssize_t chunk = limit + 1 - total < (1 << 20) ? limit + 1 - total : (1 << 20);
        do {
            got = read(fd, dst + total, (size_t)chunk);
        } while (got < 0 && errno == EINTR);
        if (got < 0) return -1;
        if (got == 0) break;
        total += got;
    }
    if (total > limit) {
        if (fstat(fd, &st) < 0) return -1;
        *size_out = total > st.st_size ? total : st.st_size;
        return -2;
    }
    return total;
}

static void decide(job_t *job, Py_ssize_t k, region_t *region, int region_index, char *lower) {
    record *rec = &job->recs[k];
    const char *path = job->paths[k];
    size_t len = (size_t)job->path_lens[k];
    size_t name_at = 0;
    for (size_t i = len; i > 0; i--)
        if (path[i - 1] == '/') {
            name_at = i;
            break;
        }
    for (size_t i = name_at; i < len; i++) {
        char c = path[i];
        lower[i - name_at] = (c >= 'A' && c <= 'Z') ? (char)(c - 'A' + 'a') : c;
    }
    int code = path_code(path, len, lower, name_at);
    if (code) {
        rec->status = ST_PATH;
        rec->code = code;
        return;
    }
    /* The section goes at the region's cursor: the heading (as for text that ends in a newline),
     * then the file read straight after it, then the closing fence. */
    char lang[16];
    size_t lang_len = language(path, len, name_at, lang);
    size_t head = 4 + len + 4 + lang_len + 1;
    size_t note = 4 + cfg.note_len;  /* "  (" note ")": for text without a final newline */
    if (region->full || region->cur + (Py_ssize_t)(head + note + 6) + job->limit + 1 > region->size) {
        region->full = 1;
        return;
    }
    char *out = region->base + region->cur;
    char *buf = out + head;
    int fd = openat(job->rootfd, path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return; /* Python says why */
    Py_ssize_t size = 0;
    Py_ssize_t n = read_file(fd, buf, job->limit, &size);
    close(fd);
    if (n == -2) {
        rec->status = ST_TOO_LARGE;
        rec->size = size;
        return;
    }
    if (n < 0) return;
    const unsigned char *u = (const unsigned char *)buf;
    if (n >= 2 && n % 2 == 0 && ((u[0] == 0xFF && u[1] == 0xFE) || (u[0] == 0xFE && u[1] == 0xFF))) return;
    rec->size = n;
    Py_ssize_t chars = utf8_chars(u, n);  /* and NULs: a NUL anywhere makes the file binary */
    if (chars == -2 || (chars == -1 && memchr(buf, 0, (size_t)n))) {
        rec->status = ST_BINARY;
        return;
    }
    if (chars < 0) return;
    Py_ssize_t probe = n < cfg.control_probe ? n : cfg.control_probe;
    for (Py_ssize_t i = 0; i < probe; i++)
        if (cfg.control[u[i]]) return;
    rec->chars = chars;
    rec->lines = count_newlines(buf, n < cfg.minified_probe ? n : cfg.minified_probe);
    rec->newline = n == 0 || buf[n - 1] == '\n';
    Py_ssize_t mprobe = n < cfg.marker_probe ? n : cfg.marker_probe;
    for (Py_ssize_t m = 0; m < cfg.markers.n; m++)
        if (cfg.markers.lens[m] && memmem(buf, (size_t)mprobe, cfg.markers.items[m], cfg.markers.lens[m])) {
            rec->status = ST_EXCLUDED;
            rec->code = 2; /* generated */
            return;
        }
    if (n >= cfg.minified_min && ends_with_any(&cfg.minifiable, lower, len - name_at)) {
        Py_ssize_t p = n < cfg.minified_probe ? n : cfg.minified_probe;
        if ((double)p / (double)(rec->lines + 1) > cfg.minified_avg_line) {
            rec->status = ST_EXCLUDED;
            rec->code = 4; /* minified */
            return;
        }
    }
    if (has_triple_backtick(buf, n)) return;
    char *at = out;
    memcpy(at, "### ", 4);
    at += 4;
    memcpy(at, path, len);
    at += len;
    if (!rec->newline) { /* the note goes in the heading: the text moves up to make room */
        memmove(buf + note, buf, (size_t)n);
        memcpy(at, "  (", 3);
        memcpy(at + 3, cfg.note, cfg.note_len);
        at[3 + cfg.note_len] = ')';
        at += note;
        buf += note;
    }
    memcpy(at, "\n```", 4);
    at += 4;
    memcpy(at, lang, lang_len);
    at += lang_len;
    *at++ = '\n';
    char *stop = buf + n;
    if (rec->newline) {
        memcpy(stop, "```\n\n", 5);
        stop += 5;
    } else {
        memcpy(stop, "\n```\n\n", 6);
        stop += 6;
    }
    rec->start = region->cur;
    rec->mid = region->cur + (at - out);
    rec->stop = rec->mid + n;
    rec->end = region->cur + (stop - out);
    rec->region = region_index;
    rec->status = ST_PACKED;
    region->cur = rec->end;
}

static void *work(void *arg) {
    worker_t *w = arg;
    job_t *job = w->job;
    region_t *region = &job->regions[w->index];
    char *lower = malloc(4096 + 1);
    if (!lower) return NULL; /* its entries stay with Python */
    for (;;) {
        Py_ssize_t first = __atomic_fetch_add(&job->next, CHUNK, __ATOMIC_RELAXED);
        if (first >= job->count) break;
        Py_ssize_t last = first + CHUNK < job->count ? first + CHUNK : job->count;
        for (Py_ssize_t k = first; k < last; k++)
            if (job->path_lens[k] <= 4096) decide(job, k, region, w->index, lower);
    }
    free(lower);
    return NULL;
}

/* layout._SIMPLE_NAME: a name printed as it is, with nothing to quote. */
static int simple_name(const char *s, Py_ssize_t n) {
    if (n == 0) return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        int word = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
        if (!word && (i == 0 || !strchr(".+@=,-/", c) || c == 0)) return 0;
    }
    return 1;
}

static PyObject *s_blob, *s_kind, *s_facts, *s_flags, *s_path, *s_size, *s_reason, *s_section, *s_content, *s_frame,
    *s_file, *s_binary, *s_too_large, *s_utf8, *s_dir, *s_submodule, *s_symlink, *s_index_blob;

static int set_int(PyObject *e, PyObject *name, Py_ssize_t v) {
    PyObject *o = PyLong_FromSsize_t(v);
    if (!o) return -1;
    int r = PyObject_SetAttr(e, name, o);
    Py_DECREF(o);
    return r;
}

static int set_new(PyObject *e, PyObject *name, PyObject *o) { /* steals o */
    if (!o) return -1;
    int r = PyObject_SetAttr(e, name, o);
    Py_DECREF(o);
    return r;
}

/* Facts(size, False, "utf-8", chars, extra, lines, final_newline, generated) of a text record. */
static PyObject *text_facts(PyObject *facts_type, const record *rec, int generated) {
    return PyObject_CallFunction(facts_type, "nOOnnnOO", rec->size, Py_False, s_utf8, rec->chars,
                                 rec->size - rec->chars, rec->lines, rec->newline ? Py_True : Py_False,
                                 generated ? Py_True : Py_False);
}

/* Is entry `e` one the C path takes: a plain name, a git blob id, kind "file", no facts or flags? */
static int eligible(PyObject *e, const char **path, Py_ssize_t *len) {
    PyObject *v = PyObject_GetAttr(e, s_blob);
    if (!v) return -1;
    int ok = v != Py_None;
    Py_DECREF(v);
    if (!ok) return 0;
    v = PyObject_GetAttr(e, s_facts);
    if (!v) return -1;
    ok = v == Py_None;
    Py_DECREF(v);
    if (!ok) return 0;
    v = PyObject_GetAttr(e, s_kind);
    if (!v) return -1;
    ok = PyUnicode_Check(v) && PyUnicode_Compare(v, s_file) == 0;
    Py_DECREF(v);
    if (!ok) return 0;
    v = PyObject_GetAttr(e, s_flags);
    if (!v) return -1;
    ok = PyObject_Not(v);
    Py_DECREF(v);
    if (ok <= 0) return ok;
    v = PyObject_GetAttr(e, s_path);
    if (!v) return -1;
    if (!PyUnicode_Check(v) || !PyUnicode_IS_ASCII(v)) {
        Py_DECREF(v);
        return 0;
    }
    *path = PyUnicode_AsUTF8AndSize(v, len); /* the string's own bytes: it lives as long as the entry */
    Py_DECREF(v);
    return *path != NULL && simple_name(*path, *len);
}

/* A scan under way: started by start(), its threads reading without the GIL while Python goes on;
 * finish() waits for them and sets what they decided on the entries. */
typedef struct {
    PyObject_HEAD
    PyObject *entries, *todo, *views, *facts_type, *reasons, *regions_obj;
    Py_buffer bufs[MAX_THREADS];
    int nbufs, nt, running, finished;
    int started[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    worker_t workers[MAX_THREADS];
    job_t job;
    region_t regions[MAX_THREADS];
    Py_ssize_t *which; /* todo position of each chosen entry */
    char *chosen;
    Py_ssize_t ntodo;
} ScanObject;

static void scan_join(ScanObject *sc) {
    if (!sc->running) return;
    Py_BEGIN_ALLOW_THREADS
    for (int t = 0; t < sc->nt; t++)
        if (sc->started[t]) pthread_join(sc->threads[t], NULL);
    Py_END_ALLOW_THREADS
    sc->running = 0;
    if (sc->job.rootfd >= 0) {
        close(sc->job.rootfd);
        sc->job.rootfd = -1;
    }
}

static void scan_dealloc(ScanObject *sc) {
    scan_join(sc); /* never free what a thread still writes to */
    for (int r = 0; r < sc->nbufs; r++) PyBuffer_Release(&sc->bufs[r]);
    if (sc->job.rootfd >= 0) close(sc->job.rootfd);
    PyMem_Free(sc->which);
    PyMem_Free((void *)sc->job.paths);
    PyMem_Free((void *)sc->job.path_lens);
    PyMem_Free(sc->job.recs);
    PyMem_Free(sc->chosen);
    Py_XDECREF(sc->entries);
    Py_XDECREF(sc->todo);
    Py_XDECREF(sc->views);
    Py_XDECREF(sc->facts_type);
    Py_XDECREF(sc->reasons);
    Py_XDECREF(sc->regions_obj);
    Py_TYPE(sc)->tp_free((PyObject *)sc);
}

static PyObject *scan_finish(ScanObject *sc, PyObject *unused) {
    if (sc->finished) {
        PyErr_SetString(PyExc_RuntimeError, "this scan is finished");
        return NULL;
    }
    scan_join(sc);
    sc->finished = 1;
    job_t *job = &sc->job;
    /* What was decided is set on the entries as reader._apply would; the rest is handed back. */
    for (Py_ssize_t k = 0; k < job->count; k++) {
        record *rec = &job->recs[k];
        PyObject *e = PyList_GET_ITEM(sc->entries, PyLong_AsSsize_t(PyList_GET_ITEM(sc->todo, sc->which[k])));
        int err = 0;
        switch (rec->status) {
        case ST_PACKED: {
            PyObject *view = PyList_GET_ITEM(sc->views, rec->region);
            err = set_int(e, s_size, rec->size) || set_new(e, s_facts, text_facts(sc->facts_type, rec, 0))
                  || set_new(e, s_section, Py_BuildValue("(Onn)", view, rec->start, rec->end));
            if (!err) {
                PyObject *lo = PyLong_FromSsize_t(rec->mid), *hi = PyLong_FromSsize_t(rec->stop);
                PyObject *slice = (lo && hi) ? PySlice_New(lo, hi, NULL) : NULL;
                Py_XDECREF(lo);
                Py_XDECREF(hi);
                err = set_new(e, s_content, slice ? PyObject_GetItem(view, slice) : NULL)
                      || set_new(e, s_frame, Py_BuildValue("(ni)", (rec->mid - rec->start) + (rec->end - rec->stop), 0));
                Py_XDECREF(slice);
            }
            break;
        }
        case ST_PATH:
            err = PyObject_SetAttr(e, s_reason, PyTuple_GET_ITEM(sc->reasons, rec->code));
            break;
        case ST_BINARY:
            err = set_int(e, s_size, rec->size)
                  || set_new(e, s_facts, PyObject_CallFunction(sc->facts_type, "nO", rec->size, Py_True))
                  || PyObject_SetAttr(e, s_reason, s_binary);
            break;
        case ST_EXCLUDED: /* generated (code 2) or minified text */
            err = PyObject_SetAttr(e, s_reason, PyTuple_GET_ITEM(sc->reasons, rec->code)) || set_int(e, s_size, rec->size)
                  || set_new(e, s_facts, text_facts(sc->facts_type, rec, rec->code == 2));
            break;
        case ST_TOO_LARGE:
            err = PyObject_SetAttr(e, s_reason, s_too_large) || set_int(e, s_size, rec->size);
            break;
        default: /* left to Python */
            continue;
        }
        if (err) return NULL;
        sc->chosen[sc->which[k]] = 1;
    }
    PyObject *left = PyList_New(0);
    if (!left) return NULL;
    for (Py_ssize_t t = 0; t < sc->ntodo; t++)
        if (!sc->chosen[t] && PyList_Append(left, PyList_GET_ITEM(sc->todo, t)) < 0) {
            Py_DECREF(left);
            return NULL;
        }
    return left;
}

static PyMethodDef scan_methods[] = {
    {"finish", (PyCFunction)scan_finish, METH_NOARGS,
     "Wait for the scan; set what it decided on the entries; the todo indices it left, for Python."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject ScanType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "agent.context._fastpack.Scan",
    .tp_basicsize = sizeof(ScanObject),
    .tp_dealloc = (destructor)scan_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A scan under way (see start).",
    .tp_methods = scan_methods,
};

static PyObject *scan_start(PyObject *self, PyObject *args) {
    int rootfd;
    PyObject *entries, *todo, *regions_obj, *views, *facts_type, *reasons;
    Py_ssize_t limit, nthreads;
    if (!PyArg_ParseTuple(args, "iO!O!nO!O!OO!n", &rootfd, &PyList_Type, &entries, &PyList_Type, &todo, &limit,
                          &PyList_Type, &regions_obj, &PyList_Type, &views, &facts_type, &PyTuple_Type, &reasons,
                          &nthreads))
        return NULL;
    if (!cfg.ready) {
        PyErr_SetString(PyExc_RuntimeError, "_fastpack.configure() has not been called");
        return NULL;
    }
    Py_ssize_t ntodo = PyList_GET_SIZE(todo), nreg = PyList_GET_SIZE(regions_obj);
    if (nreg < 1 || nreg > MAX_THREADS || PyList_GET_SIZE(views) != nreg || PyTuple_GET_SIZE(reasons) < 6) {
        PyErr_SetString(PyExc_ValueError, "between 1 and 8 regions, a view of each, and the reasons");
        return NULL;
    }
    ScanObject *sc = PyObject_New(ScanObject, &ScanType);
    if (!sc) return NULL;
    /* everything the dealloc looks at, before anything can fail */
    sc->entries = Py_NewRef(entries);
    sc->todo = Py_NewRef(todo);
    sc->views = Py_NewRef(views);
    sc->facts_type = Py_NewRef(facts_type);
    sc->reasons = Py_NewRef(reasons);
    sc->regions_obj = Py_NewRef(regions_obj);
    sc->nbufs = sc->nt = sc->running = sc->finished = 0;
    memset(sc->started, 0, sizeof sc->started);
    memset(&sc->job, 0, sizeof sc->job);
    sc->job.rootfd = -1;
    sc->ntodo = ntodo;
    sc->which = PyMem_Calloc(ntodo ? ntodo : 1, sizeof(Py_ssize_t));
    sc->chosen = PyMem_Calloc(ntodo ? ntodo : 1, 1);
    job_t *job = &sc->job;
    job->paths = PyMem_Calloc(ntodo ? ntodo : 1, sizeof(char *));
    job->path_lens = PyMem_Calloc(ntodo ? ntodo : 1, sizeof(Py_ssize_t));
    job->recs = PyMem_Calloc(ntodo ? ntodo : 1, sizeof(record));
    if (!sc->which || !sc->chosen || !job->paths || !job->path_lens || !job->recs) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_ssize_t count = 0;
    for (Py_ssize_t t = 0; t < ntodo; t++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(todo, t));
        if (i == -1 && PyErr_Occurred()) goto fail;
        if (i < 0 || i >= PyList_GET_SIZE(entries)) {
            PyErr_SetString(PyExc_IndexError, "todo holds an index past the entries");
            goto fail;
        }
        const char *path = NULL;
        Py_ssize_t len = 0;
        int ok = eligible(PyList_GET_ITEM(entries, i), &path, &len);
        if (ok < 0) goto fail;
        if (!ok) continue;
        sc->which[count] = t;
        job->paths[count] = path; /* the entry's own string: the entries list is held until the end */
        ((Py_ssize_t *)job->path_lens)[count] = len;
        job->recs[count].status = ST_GENERAL;
        count++;
    }
    for (Py_ssize_t r = 0; r < nreg; r++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(regions_obj, r), &sc->bufs[r], PyBUF_WRITABLE) < 0) goto fail;
        sc->nbufs++;
        sc->regions[r].base = sc->bufs[r].buf;
        sc->regions[r].size = sc->bufs[r].len;
        sc->regions[r].cur = 0;
        sc->regions[r].full = 0;
    }
    job->rootfd = fcntl(rootfd, F_DUPFD_CLOEXEC, 0); /* its own: the caller may close theirs */
    if (job->rootfd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    job->limit = limit;
    job->count = count;
    job->regions = sc->regions;
    job->next = 0;
    sc->nt = (int)(nthreads < 1 ? 1 : nthreads > nreg ? nreg : nthreads);
    for (int t = 0; t < sc->nt; t++) {
        sc->workers[t].job = job;
        sc->workers[t].index = t;
        sc->started[t] = pthread_create(&sc->threads[t], NULL, work, &sc->workers[t]) == 0;
    }
    sc->running = 1;
    if (!sc->started[0]) { /* no thread at all: this one reads, now */
        Py_BEGIN_ALLOW_THREADS
        work(&sc->workers[0]);
        Py_END_ALLOW_THREADS
    }
    return (PyObject *)sc;
fail:
    Py_DECREF(sc);
    return NULL;
}

/* ---- the tree (layout.tree without max_depth) ---- */

typedef struct {
    char *buf;
    size_t len, cap;
} out_t;

static int out_put(out_t *o, const char *s, size_t n) {
    if (o->len + n > o->cap) {
        size_t cap = o->cap ? o->cap : 1 << 16;
        while (cap < o->len + n) cap *= 2;
        char *b = PyMem_Realloc(o->buf, cap);
        if (!b) {
            PyErr_NoMemory();
            return -1;
        }
        o->buf = b;
        o->cap = cap;
    }
    memcpy(o->buf + o->len, s, n);
    o->len += n;
    return 0;
}

static int out_indent(out_t *o, Py_ssize_t depth) {
    for (Py_ssize_t d = 0; d < depth; d++)
        if (out_put(o, "  ", 2) < 0) return -1;
    return 0;
}

/* A name as layout.shown prints it: as it is when simple, else what shown() says. */
static int out_name(out_t *o, const char *name, Py_ssize_t n, PyObject *shown) {
    if (simple_name(name, n)) return out_put(o, name, (size_t)n);
    PyObject *raw = PyUnicode_DecodeUTF8(name, n, "surrogateescape");
    if (!raw) return -1;
    PyObject *text = PyObject_CallOneArg(shown, raw);
    Py_DECREF(raw);
    if (!text) return -1;
    Py_ssize_t len;
    const char *u = PyUnicode_AsUTF8AndSize(text, &len);
    int r = u ? out_put(o, u, (size_t)len) : -1;
    Py_DECREF(text);
    return r;
}

typedef struct {
    const char *path;
    Py_ssize_t len;
    PyObject *reason; /* borrowed from the entry (kept alive by it) or NULL for None */
    int is_dir;
} tentry;

/* Is `path` at or under directory `key` (component-wise)? */
static int under(const tentry *t, const char *key, Py_ssize_t klen) {
    return t->len >= klen && memcmp(t->path, key, (size_t)klen) == 0 && (t->len == klen || t->path[klen] == '/');
}

static PyObject *tree(PyObject *self, PyObject *args) {
    PyObject *entries, *shown, *marker, *collapsible;
    if (!PyArg_ParseTuple(args, "O!OOO", &PyList_Type, &entries, &shown, &marker, &collapsible)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(entries);
    PyObject *result = NULL, *candidates = NULL;
    PyObject **holds = PyMem_Calloc(n ? 2 * n : 1, sizeof(PyObject *)); /* the path and reason objects read */
    tentry *ts = PyMem_Calloc(n ? n : 1, sizeof(tentry));
    out_t o = {0};
    if (!holds || !ts) {
        PyErr_NoMemory();
        goto done;
    }
    candidates = PySet_New(NULL); /* directories ("a/b") holding a file skipped for a collapsible reason */
    if (!candidates) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyList_GET_ITEM(entries, i);
        PyObject *path = PyObject_GetAttr(e, s_path);
        if (!path) goto done;
        holds[2 * i] = path;
        ts[i].path = PyUnicode_AsUTF8AndSize(path, &ts[i].len);
        if (!ts[i].path) { /* surrogate escapes: the encoder refuses them; Python's tree handles it */
            PyErr_Clear();
            result = Py_NewRef(Py_None);
            goto done;
        }
        PyObject *reason = PyObject_GetAttr(e, s_reason);
        if (!reason) goto done;
        holds[2 * i + 1] = reason;
        ts[i].reason = reason == Py_None ? NULL : reason;
        PyObject *kind = PyObject_GetAttr(e, s_kind);
        if (!kind) goto done;
        ts[i].is_dir = PyUnicode_Check(kind) && PyUnicode_Compare(kind, s_dir) == 0;
        Py_DECREF(kind);
        if (ts[i].reason && !ts[i].is_dir) {
            int c = PySequence_Contains(collapsible, reason);
            if (c < 0) goto done;
            for (Py_ssize_t k = 0; c && k < ts[i].len; k++) {
                if (ts[i].path[k] != '/') continue;
                PyObject *key = PyUnicode_DecodeUTF8(ts[i].path, k, NULL);
                if (!key || PySet_Add(candidates, key) < 0) {
                    Py_XDECREF(key);
                    goto done;
                }
                Py_DECREF(key);
            }
        }
    }
    if (out_put(&o, "## Tree\n", 8) < 0) goto done;
    const char *opened = "";  /* the open directory, as a prefix of some path ("a/b/" is "a/b" + "/") */
    Py_ssize_t olen = 0, odepth = 0;
    Py_ssize_t i = 0;
    while (i < n) {
        tentry *t = &ts[i];
        Py_ssize_t cut = 0;
        for (Py_ssize_t k = t->len; k > 0; k--)
            if (t->path[k - 1] == '/') {
                cut = k;
                break;
            }
        if (cut != (olen ? olen + 1 : 0) || (olen && memcmp(t->path, opened, (size_t)olen) != 0)) {
            /* directories to open: those of this path past the components it shares with the open one */
            Py_ssize_t common = 0, depth = 0, k = 0;
            while (k < cut && k < olen + 1) {
                Py_ssize_t end = k;
                while (end < cut && t->path[end] != '/') end++;
                if (end > olen || memcmp(t->path, opened, (size_t)end) != 0 || (end < olen && opened[end] != '/'))
                    break;
                depth++;
                common = end;
                k = end + 1;
            }
            olen = common;
            odepth = depth;
            opened = t->path;
            Py_ssize_t folded_to = -1;
            Py_ssize_t start = common ? common + 1 : 0;
            while (start < cut) {
                Py_ssize_t end = start;
                while (t->path[end] != '/') end++;
                PyObject *key = PyUnicode_DecodeUTF8(t->path, end, NULL);
                if (!key) goto done;
                int c = PySet_Contains(candidates, key);
                Py_DECREF(key);
                if (c < 0) goto done;
                if (c && t->reason) { /* _fold: every entry under it skipped for this one reason */
                    int fold = PySequence_Contains(collapsible, t->reason);
                    if (fold < 0) goto done;
                    Py_ssize_t j = i;
                    while (fold && j < n && under(&ts[j], t->path, end)) {
                        if (ts[j].is_dir || !ts[j].reason) {
                            fold = 0;
                            break;
                        }
                        int same = PyObject_RichCompareBool(ts[j].reason, t->reason, Py_EQ);
                        if (same < 0) goto done;
                        if (!same) {
                            fold = 0;
                            break;
                        }
                        j++;
                    }
                    if (fold) {
                        folded_to = j;
                        Py_ssize_t count = j - i;
                        char tail[96];
                        PyObject *reason_s = PyObject_Str(t->reason);
                        if (!reason_s) goto done;
                        Py_ssize_t rlen;
                        const char *r = PyUnicode_AsUTF8AndSize(reason_s, &rlen);
                        int bad = !r || out_indent(&o, odepth) < 0
                                  || out_name(&o, t->path + start, end - start, shown) < 0
                                  || out_put(&o, "/  (skipped: ", 13) < 0 || out_put(&o, r, (size_t)rlen) < 0;
                        Py_DECREF(reason_s);
                        snprintf(tail, sizeof tail, ", %zd file%s)\n", count, count != 1 ? "s" : "");
                        if (bad || out_put(&o, tail, strlen(tail)) < 0) goto done;
                        break;
                    }
                }
                if (out_indent(&o, odepth) < 0 || out_name(&o, t->path + start, end - start, shown) < 0
                    || out_put(&o, "/\n", 2) < 0)
                    goto done;
                olen = end;
                odepth++;
                start = end + 1;
            }
            if (folded_to >= 0) {
                i = folded_to;
                continue;
            }
        }
        if (out_indent(&o, odepth) < 0 || out_name(&o, t->path + cut, t->len - cut, shown) < 0) goto done;
        if (t->is_dir && out_put(&o, "/", 1) < 0) goto done;
        if (t->reason) {
            PyObject *m = PyObject_CallOneArg(marker, PyList_GET_ITEM(entries, i));
            if (!m) goto done;
            Py_ssize_t mlen;
            const char *mu = PyUnicode_AsUTF8AndSize(m, &mlen);
            int bad = !mu || out_put(&o, mu, (size_t)mlen) < 0;
            Py_DECREF(m);
            if (bad) goto done;
        }
        if (out_put(&o, "\n", 1) < 0) goto done;
        i++;
    }
    if (out_put(&o, "\n", 1) < 0) goto done;
    result = PyUnicode_DecodeUTF8(o.buf, (Py_ssize_t)o.len, "strict");
done:
    if (holds)
        for (Py_ssize_t k = 0; k < 2 * n; k++) Py_XDECREF(holds[k]);
    PyMem_Free(holds);
    PyMem_Free(ts);
    PyMem_Free(o.buf);
    Py_XDECREF(candidates);
    return result;
}

/* ---- git's listing (selection._list_git) ---- */

/* listing(output, Entry) -> (entries: {path: Entry}, untracked: [path], tracked: bytes)
 * `output` is `git ls-files -z -t -s -o -m --exclude-standard`. Tracked files become entries (a
 * submodule or symlink through Entry(path, kind=..., ...)); a changed file's blob id moves to
 * index_blob; untracked paths are handed back as they are; `tracked` is the index's own records
 * joined by NULs (what names the cached facts snapshot). */
static PyObject *listing(PyObject *self, PyObject *args) {
    Py_buffer out;
    PyObject *entry_type;
    if (!PyArg_ParseTuple(args, "y*O", &out, &entry_type)) return NULL;
    PyObject *entries = PyDict_New(), *untracked = PyList_New(0), *result = NULL, *tracked = NULL;
    PyObject *empty = PyTuple_New(0);
    char *joined = PyMem_Malloc((size_t)out.len + 1); /* the records, each with a NUL after it */
    Py_ssize_t jlen = 0;
    if (!entries || !untracked || !empty || !joined) {
        if (!joined) PyErr_NoMemory();
        goto done;
    }
    const char *p = out.buf, *end = p + out.len;
    while (p < end) {
        const char *rec = p;
        const char *nul = memchr(p, 0, (size_t)(end - p));
        Py_ssize_t rlen = nul ? nul - p : end - p;
        p = nul ? nul + 1 : end;
        if (rlen < 2) continue;
        if (rec[0] == '?') {
            PyObject *path = PyUnicode_DecodeUTF8(rec + 2, rlen - 2, "surrogateescape");
            if (!path || PyList_Append(untracked, path) < 0) {
                Py_XDECREF(path);
                goto done;
            }
            Py_DECREF(path);
            continue;
        }
        const char *tab = memchr(rec, '\t', (size_t)rlen);
        if (!tab || tab - rec < 11) continue;
        Py_ssize_t tpos = tab - rec;
        PyObject *path = PyUnicode_DecodeUTF8(tab + 1, rlen - tpos - 1, "surrogateescape");
        if (!path) goto done;
        PyObject *blob = PyUnicode_DecodeASCII(rec + 9, tpos - 2 - 9, NULL); /* between the mode and " <stage>" */
        if (!blob) {
            Py_DECREF(path);
            goto done;
        }
        int err = 0;
        PyObject *known = PyDict_GetItemWithError(entries, path); /* borrowed */
        if (!known && PyErr_Occurred()) err = 1;
        if (!err && rec[0] == 'C') { /* changed in the work tree: the index's blob is not the file's */
            if (known) {
                PyObject *b = PyObject_GetAttr(known, s_blob);
                if (!b) {
                    err = 1;
                } else {
                    if (b != Py_None)
                        err = PyObject_SetAttr(known, s_index_blob, b) < 0 || PyObject_SetAttr(known, s_blob, Py_None) < 0;
                    Py_DECREF(b);
                }
            }
        } else if (!err) {
            memcpy(joined + jlen, rec, (size_t)rlen);
            jlen += rlen;
            joined[jlen++] = 0;
            if (!known) { /* a conflicted path has several stages: the first makes the entry */
                PyObject *e = NULL;
                if (memcmp(rec + 2, "160000", 6) == 0 || memcmp(rec + 2, "120000", 6) == 0) {
                    int sub = rec[3] == '6';
                    PyObject *kw = sub ? Py_BuildValue("{sOsO}", "kind", s_submodule, "reason", s_submodule)
                                       : Py_BuildValue("{sO}", "kind", s_symlink);
                    PyObject *a = kw ? PyTuple_Pack(1, path) : NULL;
                    e = a ? PyObject_Call(entry_type, a, kw) : NULL;
                    Py_XDECREF(a);
                    Py_XDECREF(kw);
                } else {
                    e = ((PyTypeObject *)entry_type)->tp_new((PyTypeObject *)entry_type, empty, NULL);
                    if (e && (PyObject_SetAttr(e, s_path, path) < 0 || PyObject_SetAttr(e, s_blob, blob) < 0))
                        Py_CLEAR(e);
                }
                err = !e || PyDict_SetItem(entries, path, e) < 0;
                Py_XDECREF(e);
            }
        }
        Py_DECREF(path);
        Py_DECREF(blob);
        if (err) goto done;
    }
    if (jlen) jlen--; /* no NUL after the last record */
    tracked = PyBytes_FromStringAndSize(joined, jlen);
    if (tracked) result = PyTuple_Pack(3, entries, untracked, tracked);
done:
    PyBuffer_Release(&out);
    PyMem_Free(joined);
    Py_XDECREF(entries);
    Py_XDECREF(untracked);
    Py_XDECREF(tracked);
    Py_XDECREF(empty);
    return result;
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "Set the rules' data (from agent.context.selection and layout)."},
    {"listing", listing, METH_VARARGS,
     "listing(ls_files_output, Entry) -> (entries by path, untracked paths, tracked records): see selection."},
    {"tree", tree, METH_VARARGS,
     "tree(entries, shown, marker, collapsible) -> layout.tree(entries) (None: let Python do it)."},
    {"start", scan_start, METH_VARARGS,
     "start(rootfd, entries, todo, limit, regions, views, Facts, reasons, threads) -> a Scan: decide and render "
     "the plain files among entries[todo] on up to one thread per region; its finish() sets what was decided "
     "on the entries and gives the todo indices left for Python. The entries list must not change meanwhile."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastpack",
                                    "The full pack's hot loop in C (optional; see reader.py).", -1, methods};

PyMODINIT_FUNC PyInit__fastpack(void) {
    static const char *names[] = {"blob", "kind", "facts", "flags", "path", "size", "reason", "section", "content",
                                  "frame", "file", "binary", "too-large", "utf-8", "dir", "submodule", "symlink",
                                  "index_blob"};
    PyObject **slots[] = {&s_blob, &s_kind, &s_facts, &s_flags, &s_path, &s_size, &s_reason, &s_section, &s_content,
                          &s_frame, &s_file, &s_binary, &s_too_large, &s_utf8, &s_dir, &s_submodule, &s_symlink,
                          &s_index_blob};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (!*slots[i] && !(*slots[i] = PyUnicode_InternFromString(names[i]))) return NULL;
    if (PyType_Ready(&ScanType) < 0) return NULL;
    return PyModule_Create(&module);
}
