/* The middle part of the index module (after index_core.c, before index_ext.c: native.py
   compiles the three as one source): the Python type's state, and the conversions between
   Python objects and the C table: event batches and page keys read (and validated, with the
   Python core's exceptions and messages) straight from the objects, and the PrefixMatches /
   InstanceMatch results built from ix_match's output. */

/* (tier name,) * run tuples for runs below this are made once per index and shared. */
#define UNIFORM_RUNS 256
/* Largest instance id accepted (ids are small ints the Python side hands out). */
#define MAX_IID (1 << 24)

static PyObject *s_page_keys, *s_tier, *s_tokens_per_page, *s_extra_key, *s_cache_salt;

typedef struct {
    PyObject_HEAD
    ix_t *x;
    PyObject *page_size;  /* int: BlockStored.tokens_per_page must equal it */
    PyObject *ids;        /* the PrefixIndex's dict instance name -> id (shared, read here) */
    PyObject *tier_bit;   /* tier name -> 1 << rank */
    PyObject *rank;       /* tuple of tier names, rank order (best first) */
    PyObject *known;      /* str of the sorted tier names, for the error message */
    PyTypeObject *stored, *removed, *cleared; /* the kvstrata event classes */
    PyTypeObject *matches_type, *match_type;  /* PrefixMatches, InstanceMatch */
    PyObject *invalid_event, *invalid_instance;
    PyObject *reentered; /* ReentrantCall: raised (no arguments) by a call refused by `busy` */
    PyObject *intern;  /* intern(name) -> id: the index's, for a name with no id yet */
    PyObject *as_keys; /* as_keys(query, extra_key, cache_salt) -> page keys of token ids */
    PyObject **names; /* id -> instance name (set_name), NULL when free */
    Py_ssize_t names_cap;
    PyObject **uniform; /* [tier * UNIFORM_RUNS + run]: (rank[tier],) * run, made on first use */
    int64_t *spec;      /* (kind, tier bits, key count) per event of a batch */
    int busy;           /* FREE, IN_CALL or HELD: the re-entry guard (GUARD / INNER, index_ext.c) */
    Py_ssize_t spec_cap;
} CoreObject;

/* Room for `n` gathered keys; -1 with MemoryError set. */
static int room(ix_t *x, int64_t n) {
    if (n <= x->gathered_cap) return 0;
    int64_t cap = x->gathered_cap ? x->gathered_cap : 256;
    while (cap < n) cap *= 2;
    uint8_t *g = (uint8_t *)ix_realloc(x->gathered, (size_t)(cap * x->key_len));
    if (!g) {
        PyErr_NoMemory();
        return -1;
    }
    x->gathered = g;
    x->gathered_cap = cap;
    return 0;
}

/* A batch of a million keys leaves no 32 MB buffer behind: the gathered keys go after it. */
static void shrink(ix_t *x) {
    if (x->gathered_cap > 65536) {
        free(x->gathered);
        x->gathered = 0;
        x->gathered_cap = 0;
    }
}

/* Copy the leading keys of `items` that are bytes (or a subclass) of key_len bytes into
   x->gathered; returns how many (the first other item ends them), -1 with MemoryError set. */
/* Start loading every key object (header and bytes: two lines at most) before reading any:
   a batch's keys are scattered objects, and their misses then overlap. */
static void prefetch_keys(PyObject *const *items, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        __builtin_prefetch(items[i]);
        __builtin_prefetch((const char *)items[i] + 63);
    }
}

static int64_t gather_prefix(ix_t *x, PyObject *const *items, Py_ssize_t n) {
    if (room(x, n)) return -1;
    int64_t kl = x->key_len;
    prefetch_keys(items, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = items[i];
        if (!PyBytes_Check(o) || PyBytes_GET_SIZE(o) != kl) return i;
        key_copy(x, x->gathered + i * kl, (const uint8_t *)PyBytes_AS_STRING(o));
    }
    return n;
}

/* The keys of one event, appended at x->gathered[at..]; InvalidEvent as the Python core words
   it for a key that is no bytes of key_len. Returns the count, or -1 with an exception set. */
static Py_ssize_t gather_event(CoreObject *c, PyObject *keys, int64_t at) {
    ix_t *x = c->x;
    PyObject *seq = PySequence_Fast(keys, "page_keys must be a sequence of bytes");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (room(x, at + n)) {
        Py_DECREF(seq);
        return -1;
    }
    prefetch_keys(items, n);
    int64_t kl = x->key_len;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = items[i];
        if (!PyBytes_Check(o) || PyBytes_GET_SIZE(o) != kl) {
            PyObject *r = PyObject_Repr(o);
            PyObject *cut = r ? PyUnicode_Substring(r, 0, 80) : NULL;
            if (cut)
                PyErr_Format(c->invalid_event, "page keys are %lld-byte bytes, got %U",
                             (long long)kl, cut);
            Py_XDECREF(cut);
            Py_XDECREF(r);
            Py_DECREF(seq);
            return -1;
        }
        key_copy(x, x->gathered + (at + i) * kl, (const uint8_t *)PyBytes_AS_STRING(o));
    }
    Py_DECREF(seq);
    return n;
}

/* The tier bits of `tier`, or -1 with InvalidEvent (an unknown tier) or another error set. */
static int64_t tier_bits(CoreObject *c, PyObject *tier) {
    PyObject *bit = PyDict_GetItemWithError(c->tier_bit, tier);
    if (!bit) {
        if (!PyErr_Occurred())
            PyErr_Format(c->invalid_event, "tier %R has no weight; known: %U", tier, c->known);
        return -1;
    }
    return PyLong_AsLongLong(bit);
}

/* Validate one event (the checks and messages of PrefixIndex._check_events, in its order) and
   gather its keys; spec[0..2] = (kind, bits, count). 0, or -1 with an exception set. */
static int take_event(CoreObject *c, PyObject *event, int64_t *spec, int64_t at) {
    int64_t kind;
    if (PyObject_TypeCheck(event, c->stored)) kind = 0;
    else if (PyObject_TypeCheck(event, c->removed)) kind = 1;
    else if (PyObject_TypeCheck(event, c->cleared)) kind = 2;
    else {
        PyObject *name = PyType_GetName(Py_TYPE(event));
        if (name) {
            PyErr_Format(c->invalid_event, "not a kvstrata KV event: %U", name);
            Py_DECREF(name);
        }
        return -1;
    }
    if (kind == 0) {
        PyObject *tpp = PyObject_GetAttr(event, s_tokens_per_page);
        if (!tpp) return -1;
        int other = PyObject_RichCompareBool(tpp, c->page_size, Py_NE);
        if (other > 0)
            PyErr_Format(c->invalid_event, "BlockStored of %S-token pages on an index of %S-token pages",
                         tpp, c->page_size);
        Py_DECREF(tpp);
        if (other) return -1;
    }
    PyObject *tier = PyObject_GetAttr(event, s_tier);
    if (!tier) return -1;
    int64_t bits = kind == 2 && tier == Py_None ? c->x->all_tiers : tier_bits(c, tier);
    Py_DECREF(tier);
    if (bits < 0) return -1;
    Py_ssize_t n = 0;
    if (kind != 2) {
        PyObject *keys = PyObject_GetAttr(event, s_page_keys);
        if (!keys) return -1;
        n = gather_event(c, keys, at);
        Py_DECREF(keys);
        if (n < 0) return -1;
    }
    spec[0] = kind;
    spec[1] = bits;
    spec[2] = n;
    return 0;
}

static int check_instance(CoreObject *c, PyObject *instance) {
    if (PyUnicode_Check(instance) && PyUnicode_GET_LENGTH(instance)) return 0;
    PyErr_Format(c->invalid_instance, "an instance is named by a non-empty str, got %R", instance);
    return -1;
}

/* ix_match over the first `n` gathered keys, growing the output buffers it asks for. */
static int64_t run_match(ix_t *x, int64_t n, int tiers) {
    for (;;) {
        int64_t got = ix_match(x, x->gathered, n, tiers);
        if (got >= 0) return got;
        if (got == -2) {
            int64_t cap = 2 * x->res_cap;
            int32_t *res = (int32_t *)ix_realloc(x->res, (size_t)cap * sizeof(int32_t));
            if (!res) break;
            x->res = res;
            x->res_cap = cap;
        } else if (got < -2) {
            int64_t cap = 2 * (-3 - got);
            uint8_t *pages = (uint8_t *)ix_realloc(x->pages, (size_t)cap);
            if (!pages) break;
            x->pages = pages;
            x->page_cap = cap;
        } else {
            break;
        }
    }
    PyErr_NoMemory();
    return -1;
}

static PyObject *name_of(CoreObject *c, int32_t iid) {
    if (iid < 0 || iid >= c->names_cap || !c->names[iid]) {
        PyErr_Format(PyExc_SystemError, "the index holds keys of instance id %d, which has no name",
                     (int)iid);
        return NULL;
    }
    /* A new reference: building results allocates, a collection may run a finalizer, and the
       name must outlive anything that runs meanwhile. */
    return Py_NewRef(c->names[iid]);
}

/* A tuple of the exact subclass `type` (a NamedTuple: no dict, no extra slots, checked at
   construction) holding `n` new references. */
static PyObject *new_named(PyTypeObject *type, Py_ssize_t n, PyObject **items) {
    PyObject *t = type->tp_alloc(type, n);
    if (!t) {
        for (Py_ssize_t i = 0; i < n; i++) Py_DECREF(items[i]);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(t, i, items[i]);
    return t;
}

static PyObject *repeated(PyObject *item, int64_t run) {
    PyObject *t = PyTuple_New((Py_ssize_t)run);
    if (!t) return NULL;
    for (int64_t d = 0; d < run; d++) PyTuple_SET_ITEM(t, d, Py_NewRef(item));
    return t;
}

/* (rank[tier],) * run, shared for short runs. New reference. */
static PyObject *uniform_tiers(CoreObject *c, int32_t tier, int64_t run) {
    PyObject *name = PyTuple_GET_ITEM(c->rank, tier);
    if (run >= UNIFORM_RUNS) return repeated(name, run);
    PyObject **slot = &c->uniform[(int64_t)tier * UNIFORM_RUNS + run];
    if (!*slot) *slot = repeated(name, run);
    return Py_XNewRef(*slot);
}

/* PrefixMatches(num_pages, {name: InstanceMatch(run, tiers)}, False) of the `got` instances
   ix_match wrote. */
static PyObject *matches(CoreObject *c, Py_ssize_t num_pages, int64_t got) {
    ix_t *x = c->x;
    PyObject *by = PyDict_New();
    if (!by) return NULL;
    PyObject *held = NULL; /* the name of the entry being built (name_of's new reference) */
    for (int64_t j = 0; j < got; j++) {
        int32_t run = x->res[3 * j + 1], tier = x->res[3 * j + 2];
        PyObject *name = held = name_of(c, x->res[3 * j]);
        if (!name) goto fail;
        PyObject *tiers;
        if (tier >= 0) {
            tiers = uniform_tiers(c, tier, run);
        } else {
            const uint8_t *p = x->pages + (-1 - tier);
            tiers = PyTuple_New(run);
            for (int32_t d = 0; tiers && d < run; d++)
                PyTuple_SET_ITEM(tiers, d, Py_NewRef(PyTuple_GET_ITEM(c->rank, p[d])));
        }
        if (!tiers) goto fail;
        PyObject *count = PyLong_FromLong(run);
        if (!count) {
            Py_DECREF(tiers);
            goto fail;
        }
        PyObject *pair[2] = {count, tiers};
        PyObject *m = new_named(c->match_type, 2, pair);
        if (!m) goto fail;
        int bad = PyDict_SetItem(by, name, m);
        Py_DECREF(m);
        if (bad) goto fail;
        Py_CLEAR(held);
    }
    PyObject *num = PyLong_FromSsize_t(num_pages);
    if (!num) goto fail;
    PyObject *three[3] = {num, by, Py_NewRef(Py_False)};
    return new_named(c->matches_type, 3, three);
fail:
    Py_XDECREF(held);
    Py_DECREF(by);
    return NULL;
}

/* An id argument: -1 with ValueError set when out of range. */
static long iid_arg(PyObject *arg) {
    long iid = PyLong_AsLong(arg);
    if (iid == -1 && PyErr_Occurred()) return -1;
    if (iid < 0 || iid >= MAX_IID) {
        PyErr_Format(PyExc_ValueError, "instance id %ld out of range", iid);
        return -1;
    }
    return iid;
}

/* Exactly bytes of key_len, every one (hashes, the raw calls); -1 with ValueError set. */
static int64_t gather_all(ix_t *x, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence of bytes");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int64_t m = gather_prefix(x, PySequence_Fast_ITEMS(seq), n);
    Py_DECREF(seq);
    if (m >= 0 && m < n) {
        PyErr_Format(PyExc_ValueError, "key %lld is no bytes of %lld bytes", (long long)m,
                     (long long)x->key_len);
        return -1;
    }
    return m;
}
