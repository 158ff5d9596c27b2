/* The lookup drafters' indexes in C: the n-gram index of NgramDrafter (ngram.py) and the
 * suffix index of SuffixDrafter (suffix.py). Each keeps what its pure-Python reference in
 * those files keeps, and answers the same lookups; tests/test_drafters.py and
 * tests/test_suffix.py compare the two on random texts.
 *
 * Why C: both indexes take every token of the text into a table of n-grams of several
 * lengths, one dictionary operation per length, at every step of auto mode (which keeps
 * both). In Python that is 2-4 us a token each, on the order of a GPU decode's budget for
 * all of Python; numpy cannot help with 1-5 new tokens a step. Here a token costs tens of
 * nanoseconds.
 *
 * Both tables are open addressing with linear probing on a 64-bit hash of the n-gram,
 * taken from the n-gram's last token backwards, so that one pass over a position gives the
 * hashes of all its lengths.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LENGTH 64

static inline uint64_t mix(uint64_t h, int64_t token) {
    h = (h ^ ((uint64_t)token + 0x9E3779B9ULL)) * 0x9E3779B97F4A7C15ULL;
    return h ^ (h >> 29);
}

#define SEED 0x6A09E667F3BCC909ULL

/* Items start:stop of a sequence of ints into out. A list or a tuple is read directly;
 * an item that is not an exact int is held while it is converted (its __index__ may run
 * any code, the list's own changes included: the list's size is checked at every item). */
static int read_tokens(PyObject *seq, Py_ssize_t start, Py_ssize_t stop, int64_t *out) {
    int is_list = PyList_Check(seq), is_tuple = PyTuple_Check(seq);
    for (Py_ssize_t i = start; i < stop; i++) {
        PyObject *item;
        if (is_list || is_tuple) {
            Py_ssize_t size = is_list ? PyList_GET_SIZE(seq) : PyTuple_GET_SIZE(seq);
            if (i >= size) {
                PyErr_SetString(PyExc_IndexError, "the text changed while it was read");
                return -1;
            }
            item = is_list ? PyList_GET_ITEM(seq, i) : PyTuple_GET_ITEM(seq, i);
            if (PyLong_CheckExact(item)) {
                long v = PyLong_AsLong(item);
                if (v == -1 && PyErr_Occurred()) return -1;
                out[i - start] = v;
                continue;
            }
            Py_INCREF(item);
        } else {
            item = PySequence_GetItem(seq, i);
            if (item == NULL) return -1;
        }
        long v = PyLong_AsLong(item);
        Py_DECREF(item);
        if (v == -1 && PyErr_Occurred()) return -1;
        out[i - start] = v;
    }
    return 0;
}

static int check_range(PyObject *seq, Py_ssize_t start, Py_ssize_t stop) {
    Py_ssize_t size = PySequence_Size(seq);
    if (size < 0) return -1;
    if (start < 0 || stop > size || start > stop) {
        PyErr_Format(PyExc_IndexError, "range %zd:%zd outside a text of %zd tokens", start,
                     stop, size);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- the n-gram index */

typedef struct {
    uint64_t h;
    int32_t n; /* 0: empty */
    int32_t pos; /* the position right after the latest occurrence */
    int32_t seen; /* occurrences */
    int32_t run; /* the latest ones in a row followed by the same token */
} NgramEntry;

typedef struct {
    PyObject_HEAD
    int n_min, n_max;
    NgramEntry *tab;
    size_t cap, count;
    int64_t *text;
    size_t len, text_cap;
} NgramTable;

static int ngram_alloc(NgramTable *self, size_t cap) {
    NgramEntry *tab = calloc(cap, sizeof(NgramEntry));
    if (tab == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    free(self->tab);
    self->tab = tab;
    self->cap = cap;
    self->count = 0;
    return 0;
}

static int ngram_same(const NgramTable *self, const NgramEntry *e, const int64_t *gram, int n) {
    return memcmp(self->text + e->pos - n, gram, (size_t)n * sizeof(int64_t)) == 0;
}

/* The entry of ``gram`` (n tokens, hash h), or NULL. */
static NgramEntry *ngram_find(NgramTable *self, uint64_t h, int n, const int64_t *gram) {
    size_t mask = self->cap - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
        NgramEntry *e = &self->tab[i];
        if (e->n == 0) return NULL;
        if (e->h == h && e->n == n && ngram_same(self, e, gram, n)) return e;
    }
}

static int ngram_grow(NgramTable *self) {
    NgramEntry *old = self->tab;
    size_t old_cap = self->cap, count = self->count;
    NgramEntry *tab = calloc(old_cap * 2, sizeof(NgramEntry));
    if (tab == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t mask = old_cap * 2 - 1;
    for (size_t k = 0; k < old_cap; k++) {
        if (old[k].n == 0) continue;
        size_t i = old[k].h & mask;
        while (tab[i].n != 0) i = (i + 1) & mask;
        tab[i] = old[k];
    }
    free(old);
    self->tab = tab;
    self->cap = old_cap * 2;
    self->count = count;
    return 0;
}

/* The n-gram text[j-n:j] occurred, followed by text[j]. */
static int ngram_add(NgramTable *self, uint64_t h, int n, size_t j) {
    const int64_t *gram = self->text + j - n;
    NgramEntry *e = ngram_find(self, h, n, gram);
    if (e != NULL) {
        int same = self->text[e->pos] == self->text[j];
        e->pos = (int32_t)j;
        e->seen += 1;
        e->run = same ? e->run + 1 : 1;
        return 0;
    }
    if ((self->count + 1) * 2 > self->cap && ngram_grow(self) < 0) return -1;
    size_t mask = self->cap - 1, i = h & mask;
    while (self->tab[i].n != 0) i = (i + 1) & mask;
    self->tab[i] = (NgramEntry){h, n, (int32_t)j, 1, 1};
    self->count += 1;
    return 0;
}

static void ngram_dealloc(NgramTable *self) {
    free(self->tab);
    free(self->text);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int ngram_init(NgramTable *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"n_min", "n_max", NULL};
    int n_min, n_max;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "ii", kwlist, &n_min, &n_max)) return -1;
    if (n_min < 1 || n_max < n_min || n_max > MAX_LENGTH) {
        PyErr_Format(PyExc_ValueError, "need 1 <= n_min <= n_max <= %d, got %d, %d",
                     MAX_LENGTH, n_min, n_max);
        return -1;
    }
    self->n_min = n_min;
    self->n_max = n_max;
    free(self->text);
    self->text = NULL;
    self->len = self->text_cap = 0;
    return ngram_alloc(self, 1024);
}

static int not_ready(const void *tab) {
    if (tab != NULL) return 0;
    PyErr_SetString(PyExc_RuntimeError, "the table was not initialised");
    return 1;
}

static PyObject *ngram_extend(NgramTable *self, PyObject *args) {
    PyObject *history;
    Py_ssize_t stop;
    if (not_ready(self->tab) || !PyArg_ParseTuple(args, "On", &history, &stop)) return NULL;
    if ((size_t)stop <= self->len) Py_RETURN_NONE;
    if (check_range(history, (Py_ssize_t)self->len, stop) < 0) return NULL;
    if ((size_t)stop > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "text too long for the n-gram index");
        return NULL;
    }
    size_t from = self->len, n_new = (size_t)stop - from;
    /* read first, into a buffer of its own: reading may run Python code (an item's
     * __index__), which could call this table again */
    int64_t *fresh = malloc(n_new * sizeof(int64_t));
    if (fresh == NULL) return PyErr_NoMemory();
    if (read_tokens(history, (Py_ssize_t)from, stop, fresh) < 0) {
        free(fresh);
        return NULL;
    }
    if (self->len != from) {
        free(fresh);
        PyErr_SetString(PyExc_RuntimeError, "the table changed while the text was read");
        return NULL;
    }
    if ((size_t)stop > self->text_cap) {
        size_t cap = self->text_cap ? self->text_cap : 1024;
        while (cap < (size_t)stop) cap *= 2;
        int64_t *text = realloc(self->text, cap * sizeof(int64_t));
        if (text == NULL) {
            free(fresh);
            return PyErr_NoMemory();
        }
        self->text = text;
        self->text_cap = cap;
    }
    memcpy(self->text + from, fresh, n_new * sizeof(int64_t));
    free(fresh);
    self->len = (size_t)stop;
    /* n-grams ending right before each new position j (j >= 1), followed by text[j] */
    for (size_t j = from > 1 ? from : 1; j < (size_t)stop; j++) {
        uint64_t h = SEED;
        int top = (size_t)self->n_max < j ? self->n_max : (int)j;
        for (int n = 1; n <= top; n++) {
            h = mix(h, self->text[j - n]);
            if (n >= self->n_min && ngram_add(self, h, n, j) < 0) return NULL;
        }
    }
    Py_RETURN_NONE;
}

static PyObject *ngram_find_suffix(NgramTable *self, PyObject *args) {
    PyObject *history;
    Py_ssize_t size;
    int n_hi;
    if (not_ready(self->tab) || !PyArg_ParseTuple(args, "Oni", &history, &size, &n_hi))
        return NULL;
    if (n_hi > self->n_max) n_hi = self->n_max;
    if (n_hi > size) n_hi = (int)(size > 0 ? size : 0);
    if (n_hi < self->n_min) Py_RETURN_NONE;
    if (check_range(history, size - n_hi, size) < 0) return NULL;
    int64_t gram[MAX_LENGTH];
    uint64_t hs[MAX_LENGTH + 1];
    if (read_tokens(history, size - n_hi, size, gram) < 0) return NULL;
    uint64_t h = SEED;
    for (int n = 1; n <= n_hi; n++) hs[n] = h = mix(h, gram[n_hi - n]);
    for (int n = n_hi; n >= self->n_min; n--) {
        NgramEntry *e = ngram_find(self, hs[n], n, gram + n_hi - n);
        if (e != NULL) return Py_BuildValue("iiii", n, e->pos, e->seen, e->run);
    }
    Py_RETURN_NONE;
}

static PyObject *ngram_clear(NgramTable *self, PyObject *Py_UNUSED(ignored)) {
    if (not_ready(self->tab)) return NULL;
    self->len = 0;
    if (ngram_alloc(self, 1024) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *ngram_entries(NgramTable *self, PyObject *Py_UNUSED(ignored)) {
    if (not_ready(self->tab)) return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (size_t k = 0; k < self->cap; k++) {
        NgramEntry *e = &self->tab[k];
        if (e->n == 0) continue;
        PyObject *item = Py_BuildValue("iiii", e->n, e->pos, e->seen, e->run);
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    return out;
}

static PyObject *ngram_nbytes(NgramTable *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSize_t(self->cap * sizeof(NgramEntry) + self->text_cap * sizeof(int64_t));
}

static PyObject *ngram_length(NgramTable *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSize_t(self->len);
}

static PyMethodDef ngram_methods[] = {
    {"extend", (PyCFunction)ngram_extend, METH_VARARGS,
     "extend(history, stop): take in history[len(self):stop] and index the n-grams ending "
     "right before each of those positions (from 1)."},
    {"find", (PyCFunction)ngram_find_suffix, METH_VARARGS,
     "find(history, size, n_hi) -> (n, pos, seen, run) | None: the longest n-gram of "
     "history[:size]'s end, n_hi down to n_min, that was indexed."},
    {"clear", (PyCFunction)ngram_clear, METH_NOARGS, "forget everything"},
    {"entries", (PyCFunction)ngram_entries, METH_NOARGS,
     "entries() -> [(n, pos, seen, run)]: every n-gram indexed (for tests)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ngram_getset[] = {
    {"nbytes", (getter)ngram_nbytes, NULL, "bytes held", NULL},
    {"length", (getter)ngram_length, NULL, "tokens taken in", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject NgramTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specgguf.speculative.drafters._lookup.NgramTable",
    .tp_doc = "The n-gram index of NgramDrafter: for each n-gram of n_min to n_max tokens, "
              "the position after its latest occurrence, its occurrences, and how many of "
              "the latest in a row were followed by the same token.",
    .tp_basicsize = sizeof(NgramTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ngram_init,
    .tp_dealloc = (destructor)ngram_dealloc,
    .tp_methods = ngram_methods,
    .tp_getset = ngram_getset,
};

/* ---------------------------------------------------------------- the suffix index */

typedef struct {
    uint64_t h;
    int32_t n; /* 0: empty */
    int32_t count; /* occurrences held, at most max_occurrences */
    int32_t head; /* the oldest one's place in its ring */
    int32_t ring; /* its ring's first place in the arena */
} SuffixEntry;

typedef struct {
    PyObject_HEAD
    int lengths[8];
    int n_lengths, top, most;
    int64_t separator;
    SuffixEntry *tab;
    size_t cap, count;
    int32_t *arena; /* count rings of `most` positions */
    size_t arena_cap; /* in rings */
} SuffixTable;

static int suffix_alloc(SuffixTable *self, size_t cap) {
    SuffixEntry *tab = calloc(cap, sizeof(SuffixEntry));
    if (tab == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    free(self->tab);
    self->tab = tab;
    self->cap = cap;
    self->count = 0;
    return 0;
}

static SuffixEntry *suffix_find(SuffixTable *self, uint64_t h, int n) {
    size_t mask = self->cap - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
        SuffixEntry *e = &self->tab[i];
        if (e->n == 0) return NULL;
        if (e->h == h && e->n == n) return e;
    }
}

static int suffix_grow(SuffixTable *self) {
    SuffixEntry *old = self->tab;
    size_t old_cap = self->cap, count = self->count;
    SuffixEntry *tab = calloc(old_cap * 2, sizeof(SuffixEntry));
    if (tab == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t mask = old_cap * 2 - 1;
    for (size_t k = 0; k < old_cap; k++) {
        if (old[k].n == 0) continue;
        size_t i = old[k].h & mask;
        while (tab[i].n != 0) i = (i + 1) & mask;
        tab[i] = old[k];
    }
    free(old);
    self->tab = tab;
    self->cap = old_cap * 2;
    self->count = count;
    return 0;
}

static int suffix_add(SuffixTable *self, uint64_t h, int n, int32_t j) {
    SuffixEntry *e = suffix_find(self, h, n);
    if (e == NULL) {
        if ((self->count + 1) * (size_t)self->most > INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "too many n-grams for the suffix index");
            return -1;
        }
        if ((self->count + 1) * 2 > self->cap && suffix_grow(self) < 0) return -1;
        if (self->count + 1 > self->arena_cap) {
            size_t rings = self->arena_cap ? self->arena_cap * 2 : 64;
            int32_t *arena = realloc(self->arena, rings * self->most * sizeof(int32_t));
            if (arena == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            self->arena = arena;
            self->arena_cap = rings;
        }
        size_t mask = self->cap - 1, i = h & mask;
        while (self->tab[i].n != 0) i = (i + 1) & mask;
        self->tab[i] = (SuffixEntry){h, n, 0, 0, (int32_t)(self->count * self->most)};
        self->count += 1;
        e = &self->tab[i];
    }
    int32_t *ring = self->arena + e->ring;
    if (e->count < self->most) {
        ring[(e->head + e->count) % self->most] = j;
        e->count += 1;
    } else {
        ring[e->head] = j;
        e->head = (e->head + 1) % self->most;
    }
    return 0;
}

static void suffix_dealloc(SuffixTable *self) {
    free(self->tab);
    free(self->arena);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int suffix_init(SuffixTable *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"lengths", "max_occurrences", "separator", NULL};
    PyObject *lengths;
    int most;
    long long separator;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OiL", kwlist, &lengths, &most, &separator))
        return -1;
    PyObject *fast = PySequence_Fast(lengths, "lengths must be a sequence of ints");
    if (fast == NULL) return -1;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(fast);
    if (k < 1 || k > 8) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "need 1 to 8 lengths");
        return -1;
    }
    int prev = 0, lengths_ok[8];
    for (Py_ssize_t i = 0; i < k; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        if (v <= prev || v > MAX_LENGTH) {
            Py_DECREF(fast);
            PyErr_Format(PyExc_ValueError, "lengths must rise, from 1 to %d", MAX_LENGTH);
            return -1;
        }
        lengths_ok[i] = prev = (int)v;
    }
    Py_DECREF(fast);
    if (most < 1) {
        PyErr_SetString(PyExc_ValueError, "max_occurrences must be at least 1");
        return -1;
    }
    memcpy(self->lengths, lengths_ok, (size_t)k * sizeof(int));
    self->n_lengths = (int)k;
    self->top = prev;
    self->most = most;
    self->separator = separator;
    free(self->arena);
    self->arena = NULL;
    self->arena_cap = 0;
    return suffix_alloc(self, 1024);
}

static PyObject *suffix_index(SuffixTable *self, PyObject *args) {
    PyObject *corpus;
    Py_ssize_t start, stop;
    if (not_ready(self->tab) || !PyArg_ParseTuple(args, "Onn", &corpus, &start, &stop))
        return NULL;
    if (start < 1) start = 1;
    if (stop <= start) Py_RETURN_NONE;
    if (stop - 1 > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "corpus too long for the suffix index");
        return NULL;
    }
    Py_ssize_t from = start > self->top ? start - self->top : 0;
    if (check_range(corpus, from, stop) < 0) return NULL;
    Py_ssize_t span = stop - from;
    int64_t small[1024];
    int64_t *c = span <= 1024 ? small : malloc((size_t)span * sizeof(int64_t));
    if (c == NULL) return PyErr_NoMemory();
    PyObject *result = NULL;
    if (read_tokens(corpus, from, stop, c) < 0) goto done;
    /* the n-grams ending right before each position j, at each length, none across a
     * separator */
    for (Py_ssize_t j = start; j < stop; j++) {
        uint64_t h = SEED;
        int li = 0;
        for (int n = 1; n <= self->top && j - n >= 0; n++) {
            int64_t t = c[j - n - from];
            if (t == self->separator) break;
            h = mix(h, t);
            if (n == self->lengths[li]) {
                if (suffix_add(self, h, n, (int32_t)j) < 0) goto done;
                li++;
            }
        }
    }
    result = Py_None;
    Py_INCREF(result);
done:
    if (c != small) free(c);
    return result;
}

static PyObject *suffix_match(SuffixTable *self, PyObject *args) {
    PyObject *corpus;
    Py_ssize_t end, n_hi;
    if (not_ready(self->tab) || !PyArg_ParseTuple(args, "Onn", &corpus, &end, &n_hi))
        return NULL;
    int top = n_hi < self->top ? (int)n_hi : self->top;
    if (top > end) top = (int)(end > 0 ? end : 0);
    if (top < 1) Py_RETURN_NONE;
    if (check_range(corpus, end - top, end) < 0) return NULL;
    int64_t gram[MAX_LENGTH];
    uint64_t hs[MAX_LENGTH + 1];
    if (read_tokens(corpus, end - top, end, gram) < 0) return NULL;
    uint64_t h = SEED;
    for (int n = 1; n <= top; n++) hs[n] = h = mix(h, gram[top - n]);
    for (int li = self->n_lengths - 1; li >= 0; li--) {
        int n = self->lengths[li];
        if (n > top) continue;
        SuffixEntry *e = suffix_find(self, hs[n], n);
        if (e == NULL) continue;
        PyObject *occ = PyList_New(e->count);
        if (occ == NULL) return NULL;
        const int32_t *ring = self->arena + e->ring;
        for (int32_t k = 0; k < e->count; k++) {
            PyObject *v = PyLong_FromLong(ring[(e->head + k) % self->most]);
            if (v == NULL) {
                Py_DECREF(occ);
                return NULL;
            }
            PyList_SET_ITEM(occ, k, v);
        }
        return Py_BuildValue("iN", n, occ);
    }
    Py_RETURN_NONE;
}

static PyObject *suffix_clear(SuffixTable *self, PyObject *Py_UNUSED(ignored)) {
    if (not_ready(self->tab)) return NULL;
    if (suffix_alloc(self, 1024) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *suffix_entries(SuffixTable *self, PyObject *Py_UNUSED(ignored)) {
    if (not_ready(self->tab)) return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (size_t k = 0; k < self->cap; k++) {
        SuffixEntry *e = &self->tab[k];
        if (e->n == 0) continue;
        PyObject *occ = PyList_New(e->count);
        if (occ == NULL) goto fail;
        for (int32_t i = 0; i < e->count; i++) {
            PyObject *v = PyLong_FromLong(self->arena[e->ring + (e->head + i) % self->most]);
            if (v == NULL) {
                Py_DECREF(occ);
                goto fail;
            }
            PyList_SET_ITEM(occ, i, v);
        }
        PyObject *item = Py_BuildValue("iN", e->n, occ);
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            goto fail;
        }
        Py_DECREF(item);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *suffix_nbytes(SuffixTable *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSize_t(self->cap * sizeof(SuffixEntry) +
                             self->arena_cap * self->most * sizeof(int32_t));
}

static PyMethodDef suffix_methods[] = {
    {"index", (PyCFunction)suffix_index, METH_VARARGS,
     "index(corpus, start, stop): index the n-grams ending right before each position of "
     "start:stop (from 1), at each length, none across a separator."},
    {"match", (PyCFunction)suffix_match, METH_VARARGS,
     "match(corpus, end, n_hi) -> (n, positions) | None: the longest indexed n-gram (of "
     "the lengths, at most n_hi) of corpus[:end]'s end, and the positions after its latest "
     "occurrences, oldest first."},
    {"clear", (PyCFunction)suffix_clear, METH_NOARGS, "forget everything"},
    {"entries", (PyCFunction)suffix_entries, METH_NOARGS,
     "entries() -> [(n, positions)]: every n-gram indexed (for tests)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef suffix_getset[] = {
    {"nbytes", (getter)suffix_nbytes, NULL, "bytes held", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SuffixTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specgguf.speculative.drafters._lookup.SuffixTable",
    .tp_doc = "The suffix index of SuffixDrafter: for each n-gram of the given lengths, the "
              "positions after its latest max_occurrences occurrences.",
    .tp_basicsize = sizeof(SuffixTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)suffix_init,
    .tp_dealloc = (destructor)suffix_dealloc,
    .tp_methods = suffix_methods,
    .tp_getset = suffix_getset,
};

static struct PyModuleDef lookup_module = {
    PyModuleDef_HEAD_INIT,
    "_lookup",
    "The lookup drafters' n-gram and suffix indexes, compiled (ngram.py and suffix.py hold "
    "their pure-Python references).",
    -1,
    NULL,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__lookup(void) {
    if (PyType_Ready(&NgramTableType) < 0 || PyType_Ready(&SuffixTableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&lookup_module);
    if (m == NULL) return NULL;
    Py_INCREF(&NgramTableType);
    Py_INCREF(&SuffixTableType);
    if (PyModule_AddIntConstant(m, "MAX_LENGTH", MAX_LENGTH) < 0 ||
        PyModule_AddObject(m, "NgramTable", (PyObject *)&NgramTableType) < 0 ||
        PyModule_AddObject(m, "SuffixTable", (PyObject *)&SuffixTableType) < 0) {
        Py_DECREF(&NgramTableType);
        Py_DECREF(&SuffixTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
