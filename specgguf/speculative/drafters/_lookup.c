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

/* ---------------------------------------------------------------- drafting from the
 * suffix index's occurrences: SuffixDrafter.propose and propose_tree (suffix.py, their
 * pure-Python references, which tests/test_suffix.py compares with these), and
 * match_length (ngram.py).
 *
 * Why C: at each step of auto mode these follow up to max_occurrences earlier positions
 * token by token, grouping them by the token that comes next (a dictionary per node in
 * Python: about 40 us a step for a tree of 4 nodes, a third of auto mode's planning on a
 * tiny target). Here it is about a microsecond. */

/* The token at position i of a list or tuple (or any sequence), Python's negative indexes
 * included; -1 with an exception set where there is none or it is not an int. */
static int token_at(PyObject *seq, Py_ssize_t i, int64_t *out) {
    PyObject *item;
    int owned = 0;
    if (PyList_CheckExact(seq) || PyTuple_CheckExact(seq)) {
        Py_ssize_t size = PyList_CheckExact(seq) ? PyList_GET_SIZE(seq) : PyTuple_GET_SIZE(seq);
        if (i < 0) i += size;
        if (i < 0 || i >= size) {
            PyErr_SetString(PyExc_IndexError, "token index out of range");
            return -1;
        }
        item = PyList_CheckExact(seq) ? PyList_GET_ITEM(seq, i) : PyTuple_GET_ITEM(seq, i);
        if (!PyLong_CheckExact(item)) {
            Py_INCREF(item);
            owned = 1;
        }
    } else {
        item = PySequence_GetItem(seq, i);
        if (item == NULL) return -1;
        owned = 1;
    }
    long v = PyLong_AsLong(item);
    if (owned) Py_DECREF(item);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* LONG_MATCH of ngram.py: the longest match match_length measures */
#define LONG_MATCH 32

static PyObject *lookup_match_length(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *text, *stop_obj = Py_None;
    Py_ssize_t after, end, n;
    if (!PyArg_ParseTuple(args, "Onnn|O", &text, &after, &end, &n, &stop_obj)) return NULL;
    int has_stop = stop_obj != Py_None;
    int64_t stop = 0;
    if (has_stop) {
        long v = PyLong_AsLong(stop_obj);
        if (v == -1 && PyErr_Occurred()) return NULL;
        stop = v;
    }
    Py_ssize_t m = n;
    while (m < LONG_MATCH && after - 1 - m >= 0) {
        int64_t t, u;
        if (token_at(text, after - 1 - m, &t) < 0) return NULL;
        if (has_stop && t == stop) break;
        if (token_at(text, end - 1 - m, &u) < 0) return NULL;
        if (t != u) break;
        m += 1;
    }
    return PyLong_FromSsize_t(m);
}

/* The positions of occ as int64 (Python ints), into a new array; NULL on error. */
static int64_t *read_positions(PyObject *occ, Py_ssize_t *n_out) {
    PyObject *fast = PySequence_Fast(occ, "occurrences must be a sequence of ints");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    int64_t *pos = malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    if (pos == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* (an item's __index__ may run any code, the list's own changes included) */
        if (i >= PySequence_Fast_GET_SIZE(fast)) {
            Py_DECREF(fast);
            free(pos);
            PyErr_SetString(PyExc_IndexError, "the occurrences changed while they were read");
            return NULL;
        }
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        Py_INCREF(item);
        long v = PyLong_AsLong(item);
        Py_DECREF(item);
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            free(pos);
            return NULL;
        }
        pos[i] = v;
    }
    Py_DECREF(fast);
    *n_out = n;
    return pos;
}

/* The occurrences pos[0:n] grouped by the token at pos + depth (those at or past end, or
 * on a separator, left out): the groups' tokens and sizes in the order first seen, and
 * each occurrence's group (-1: left out) in group_of. Returns the number of groups, -1 on
 * error. tokens, sizes and group_of hold n items each. */
static Py_ssize_t group_next(PyObject *corpus, Py_ssize_t end, int64_t sep, const int64_t *pos,
                             Py_ssize_t n, Py_ssize_t depth, int64_t *tokens, Py_ssize_t *sizes,
                             Py_ssize_t *group_of) {
    Py_ssize_t n_groups = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        group_of[i] = -1;
        if (pos[i] + depth >= end) continue;
        int64_t t;
        if (token_at(corpus, pos[i] + depth, &t) < 0) return -1;
        if (t == sep) continue;
        Py_ssize_t g = 0;
        while (g < n_groups && tokens[g] != t) g++;
        if (g == n_groups) {
            tokens[g] = t;
            sizes[g] = 0;
            n_groups++;
        }
        sizes[g]++;
        group_of[i] = g;
    }
    return n_groups;
}

/* Room for one more item in each of the out arrays (tokens, and probs and parents where
 * not NULL), doubled as they fill: a draft's length is not bounded by the k asked for (any
 * int) but by what follows the occurrences. */
static int grow(Py_ssize_t len, Py_ssize_t *cap, int64_t **tokens, double **probs,
                int64_t **parents) {
    if (len < *cap) return 0;
    Py_ssize_t want = *cap ? *cap * 2 : 64;
    int64_t *t = realloc(*tokens, (size_t)want * sizeof(int64_t));
    if (t) *tokens = t;
    double *p = realloc(*probs, (size_t)want * sizeof(double));
    if (p) *probs = p;
    int64_t *q = parents ? realloc(*parents, (size_t)want * sizeof(int64_t)) : NULL;
    if (q) *parents = q;
    if (!t || !p || (parents && !q)) {
        PyErr_NoMemory();
        return -1;
    }
    *cap = want;
    return 0;
}

static PyObject *float_list(const double *v, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyFloat_FromDouble(v[i]);
        if (x == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, x);
    }
    return out;
}

static PyObject *int_list(const int64_t *v, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (x == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, x);
    }
    return out;
}

static PyObject *lookup_suffix_chain(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *corpus, *occ_obj;
    Py_ssize_t end, k;
    double share_min;
    long long sep;
    if (!PyArg_ParseTuple(args, "OnOndL", &corpus, &end, &occ_obj, &k, &share_min, &sep))
        return NULL;
    Py_ssize_t n;
    int64_t *pos = read_positions(occ_obj, &n);
    if (pos == NULL) return NULL;
    Py_ssize_t cap = n > 0 ? n : 1, kk = k > 0 ? k : 0, out_cap = 0;
    int64_t *gtok = malloc((size_t)cap * sizeof(int64_t));
    Py_ssize_t *gsize = malloc((size_t)cap * sizeof(Py_ssize_t));
    Py_ssize_t *group_of = malloc((size_t)cap * sizeof(Py_ssize_t));
    int64_t *tokens = NULL;
    double *probs = NULL;
    PyObject *result = NULL;
    if (!gtok || !gsize || !group_of) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t len = 0;
    double confidence = 1.0;
    while (n > 0 && len < kk) {
        Py_ssize_t ng = group_next(corpus, end, sep, pos, n, len, gtok, gsize, group_of);
        if (ng < 0) goto done;
        if (ng == 0) break;
        /* the most occurrences, ties to the larger token (suffix.py's max) */
        Py_ssize_t best = 0;
        for (Py_ssize_t g = 1; g < ng; g++)
            if (gsize[g] > gsize[best] || (gsize[g] == gsize[best] && gtok[g] > gtok[best]))
                best = g;
        double share = (double)gsize[best] / (double)n;
        if (share <= share_min && len > 0) break;
        if (grow(len, &out_cap, &tokens, &probs, NULL) < 0) goto done;
        confidence *= share;
        tokens[len] = gtok[best];
        probs[len] = confidence;
        len++;
        Py_ssize_t kept = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            if (group_of[i] == best) pos[kept++] = pos[i];
        n = kept;
    }
    PyObject *t = int_list(tokens, len), *p = t ? float_list(probs, len) : NULL;
    if (t && p) result = Py_BuildValue("NN", t, p);
    else {
        Py_XDECREF(t);
        Py_XDECREF(p);
    }
done:
    free(pos);
    free(gtok);
    free(gsize);
    free(group_of);
    free(tokens);
    free(probs);
    return result;
}

/* A candidate node of suffix_tree: (-probability, order) is heapq's order in suffix.py */
typedef struct {
    double neg;
    Py_ssize_t order, parent, depth;
    int64_t token;
    Py_ssize_t off, n; /* its occurrences: arena[off:off + n] */
} Candidate;

static int cand_before(const Candidate *a, const Candidate *b) {
    return a->neg < b->neg || (a->neg == b->neg && a->order < b->order);
}

typedef struct {
    PyObject *corpus;
    Py_ssize_t end;
    int64_t sep;
    double min_prob;
    int64_t *arena; /* every candidate's occurrences */
    Py_ssize_t arena_len, arena_cap;
    Candidate *heap;
    Py_ssize_t heap_len, heap_cap;
    Py_ssize_t order;
    int64_t *gtok;
    Py_ssize_t *gsize, *group_of, *rank, gcap;
} Tree;

static int tree_push(Tree *tr, Candidate c) {
    if (tr->heap_len == tr->heap_cap) {
        Py_ssize_t cap = tr->heap_cap ? tr->heap_cap * 2 : 64;
        Candidate *h = realloc(tr->heap, (size_t)cap * sizeof(Candidate));
        if (h == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        tr->heap = h;
        tr->heap_cap = cap;
    }
    Py_ssize_t i = tr->heap_len++;
    while (i > 0) {
        Py_ssize_t up = (i - 1) / 2;
        if (!cand_before(&c, &tr->heap[up])) break;
        tr->heap[i] = tr->heap[up];
        i = up;
    }
    tr->heap[i] = c;
    return 0;
}

static Candidate tree_pop(Tree *tr) {
    Candidate top = tr->heap[0], last = tr->heap[--tr->heap_len];
    Py_ssize_t i = 0, n = tr->heap_len;
    for (;;) {
        Py_ssize_t l = 2 * i + 1, r = l + 1, m = i;
        const Candidate *best = &last;
        if (l < n && cand_before(&tr->heap[l], best)) m = l, best = &tr->heap[l];
        if (r < n && cand_before(&tr->heap[r], best)) m = r;
        if (m == i) break;
        tr->heap[i] = tr->heap[m];
        i = m;
    }
    if (n > 0) tr->heap[i] = last;
    return top;
}

/* suffix.py's expand: the candidates that continue node `parent` (its occurrences
 * arena[off:off + n], at `depth`), the largest groups first (ties: the larger token) where
 * there are several. */
static int tree_expand(Tree *tr, Py_ssize_t parent, Py_ssize_t depth, double prob,
                       Py_ssize_t off, Py_ssize_t n) {
    if (n > tr->gcap) {
        Py_ssize_t cap = n;
        int64_t *gt = realloc(tr->gtok, (size_t)cap * sizeof(int64_t));
        if (gt) tr->gtok = gt;
        Py_ssize_t *gs = realloc(tr->gsize, (size_t)cap * sizeof(Py_ssize_t));
        if (gs) tr->gsize = gs;
        Py_ssize_t *go = realloc(tr->group_of, (size_t)cap * sizeof(Py_ssize_t));
        if (go) tr->group_of = go;
        Py_ssize_t *rk = realloc(tr->rank, (size_t)cap * sizeof(Py_ssize_t));
        if (rk) tr->rank = rk;
        if (!gt || !gs || !go || !rk) {
            PyErr_NoMemory();
            return -1;
        }
        tr->gcap = cap;
    }
    /* the groups share out the node's n occurrences: room for n more */
    if (tr->arena_len + n > tr->arena_cap) {
        Py_ssize_t cap = (tr->arena_len + n) * 2;
        int64_t *a = realloc(tr->arena, (size_t)cap * sizeof(int64_t));
        if (a == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        tr->arena = a;
        tr->arena_cap = cap;
    }
    Py_ssize_t ng = group_next(tr->corpus, tr->end, tr->sep, tr->arena + off, n, depth, tr->gtok,
                               tr->gsize, tr->group_of);
    if (ng < 0) return -1;
    /* the groups' order: as first seen for one, else by size, then the larger token */
    for (Py_ssize_t g = 0; g < ng; g++) tr->rank[g] = g;
    if (ng > 1) {
        for (Py_ssize_t a = 1; a < ng; a++) {
            Py_ssize_t g = tr->rank[a], b = a;
            while (b > 0) {
                Py_ssize_t h = tr->rank[b - 1];
                int after = tr->gsize[h] < tr->gsize[g] ||
                            (tr->gsize[h] == tr->gsize[g] && tr->gtok[h] < tr->gtok[g]);
                if (!after) break;
                tr->rank[b] = h;
                b--;
            }
            tr->rank[b] = g;
        }
    }
    for (Py_ssize_t r = 0; r < ng; r++) {
        Py_ssize_t g = tr->rank[r];
        double p = prob * (double)tr->gsize[g] / (double)n;
        if (!(p >= tr->min_prob)) continue;
        Py_ssize_t start = tr->arena_len;
        for (Py_ssize_t i = 0; i < n; i++)
            if (tr->group_of[i] == g) tr->arena[tr->arena_len++] = tr->arena[off + i];
        Candidate c = {-p, tr->order++, parent, depth + 1, tr->gtok[g], start, tr->gsize[g]};
        if (tree_push(tr, c) < 0) return -1;
    }
    return 0;
}

static PyObject *lookup_suffix_tree(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *corpus, *occ_obj;
    Py_ssize_t end, max_nodes, max_leaves, enough, branch;
    double min_prob;
    long long sep;
    if (!PyArg_ParseTuple(args, "OnOnndnnL", &corpus, &end, &occ_obj, &max_nodes, &max_leaves,
                          &min_prob, &enough, &branch, &sep))
        return NULL;
    Py_ssize_t n_occ;
    int64_t *occ = read_positions(occ_obj, &n_occ);
    if (occ == NULL) return NULL;
    Tree tr = {corpus, end, sep, min_prob, NULL, 0, 0, NULL, 0, 0, 0, NULL, NULL, NULL, NULL, 0};
    Py_ssize_t cap = 0;
    int64_t *tokens = NULL, *parents = NULL;
    double *probs = NULL;
    char *has_child = NULL;
    PyObject *result = NULL;
    Py_ssize_t len = 0, n_leaves = 0, first = -1, first_len = 0;
    if (n_occ > 0 && max_nodes > 0 && max_leaves > 0) {
        tr.arena = malloc((size_t)(2 * n_occ) * sizeof(int64_t));
        if (tr.arena == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        memcpy(tr.arena, occ, (size_t)n_occ * sizeof(int64_t));
        tr.arena_len = n_occ;
        tr.arena_cap = 2 * n_occ;
        if (tree_expand(&tr, -1, 0, 1.0, 0, n_occ) < 0) goto done;
    }
    while (tr.heap_len > 0 && len < max_nodes) {
        Candidate c = tree_pop(&tr);
        int opens = c.parent < 0 ? len > 0 : has_child[c.parent];
        if (opens && n_leaves >= max_leaves) continue; /* a new leaf beside others: no room */
        if (len == cap) {
            Py_ssize_t was = cap;
            if (grow(len, &cap, &tokens, &probs, &parents) < 0) goto done;
            char *h = realloc(has_child, (size_t)cap);
            if (h == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            memset(h + was, 0, (size_t)(cap - was));
            has_child = h;
        }
        n_leaves += opens || len == 0;
        if (c.parent >= 0) has_child[c.parent] = 1;
        tokens[len] = c.token;
        parents[len] = c.parent;
        probs[len] = -c.neg;
        len++;
        if (c.parent == first) {
            first = len - 1;
            first_len++;
        }
        if (len >= enough && first_len >= branch) break;
        if (tree_expand(&tr, len - 1, c.depth, -c.neg, c.off, c.n) < 0) goto done;
    }
    PyObject *t = int_list(tokens, len), *pa = t ? int_list(parents, len) : NULL;
    PyObject *p = pa ? float_list(probs, len) : NULL;
    if (t && pa && p) result = Py_BuildValue("NNN", t, pa, p);
    else {
        Py_XDECREF(t);
        Py_XDECREF(pa);
        Py_XDECREF(p);
    }
done:
    free(occ);
    free(tokens);
    free(parents);
    free(probs);
    free(has_child);
    free(tr.arena);
    free(tr.heap);
    free(tr.gtok);
    free(tr.gsize);
    free(tr.group_of);
    free(tr.rank);
    return result;
}

static PyMethodDef lookup_functions[] = {
    {"match_length", lookup_match_length, METH_VARARGS,
     "match_length(text, after, end, n, stop=None) -> int: ngram.py's match_length."},
    {"suffix_chain", lookup_suffix_chain, METH_VARARGS,
     "suffix_chain(corpus, end, occ, k, share_min, separator) -> (tokens, probs): "
     "SuffixDrafter.propose's chain from the occurrences occ."},
    {"suffix_tree", lookup_suffix_tree, METH_VARARGS,
     "suffix_tree(corpus, end, occ, max_nodes, max_leaves, min_prob, enough, branch, "
     "separator) -> (tokens, parents, probs): SuffixDrafter.propose_tree's tree from the "
     "occurrences occ, stopped at `enough` nodes once its first branch has `branch`."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef lookup_module = {
    PyModuleDef_HEAD_INIT,
    "_lookup",
    "The lookup drafters' n-gram and suffix indexes, compiled (ngram.py and suffix.py hold "
    "their pure-Python references).",
    -1,
    lookup_functions,
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
