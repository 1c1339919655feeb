/* The second half of the index module (after index_core.c: native.py compiles the two files as
   one source, an extension module of this interpreter): the integrity check, then the Python
   type `Core` that PrefixIndex calls. One call serves a whole event batch (`apply`) or a whole
   lookup (`find`, `lengths`): the keys are read straight from the bytes objects
   (PyBytes_AS_STRING), the events and instance name are validated here, before any change,
   with the exceptions and messages of the Python core, and the results are built here as the
   PrefixMatches / InstanceMatch tuples the Python core returns. Calls hold the GIL. */


/* 0 when every invariant holds, else the number of the first that does not (Core.check):
   1 a slot names a bad or free entry, 2 a slot's hash bits or place are wrong, 3 slot count
   != live entries, 4 holders unsorted / empty tiers / unknown tier bits, 5 a holder's position
   disagrees with its instance list, 6 pairs disagree, 7 LRU order broken or incomplete,
   8 entry bound exceeded, 9 free list broken. */
static int64_t ix_check(ix_t *x) {
    uint64_t filled = 0;
    for (uint64_t i = 0; i <= x->mask; i++) {
        uint64_t s = x->slots[i];
        if (!s) continue;
        filled++;
        uint32_t idx = (uint32_t)s - 1;
        if (idx >= x->used || !x->E[idx].n) return 1;
        uint64_t where;
        uint32_t tag = (uint32_t)key_hash(x, x->E[idx].key);
        if ((uint32_t)(s >> 32) != tag || find_slot(x, x->E[idx].key, tag, &where) != idx ||
            where != i)
            return 2;
    }
    if (filled != x->live) return 3;
    int64_t pairs = 0;
    for (uint32_t idx = 0; idx < x->used; idx++) {
        entry_t *e = &x->E[idx];
        if (!e->n) continue;
        holder_t *h = holders(e);
        for (uint32_t j = 0; j < e->n; j++) {
            if (!h[j].tiers || (h[j].tiers & ~(uint32_t)x->all_tiers) ||
                (j && h[j - 1].iid >= h[j].iid) || h[j].iid >= x->icap)
                return 4;
            inst_t *in = &x->I[h[j].iid];
            if (h[j].pos >= in->n || in->k[h[j].pos] != idx) return 5;
        }
        pairs += e->n;
    }
    int64_t listed = 0;
    for (uint32_t i = 0; i < x->icap; i++) listed += x->I[i].n;
    if (pairs != x->pairs || listed != pairs) return 6;
    if (x->max_entries) {
        uint64_t seen = 0;
        uint32_t prev = NIL;
        for (uint32_t i = x->lru_head; i != NIL; i = x->E[i].next) {
            if (x->E[i].prev != prev || !x->E[i].n || ++seen > x->live) return 7;
            prev = i;
        }
        if (seen != x->live || prev != x->lru_tail) return 7;
        if (x->live > (uint64_t)x->max_entries) return 8;
    }
    uint64_t free_count = 0;
    for (uint32_t i = x->free_head; i != NIL; i = x->E[i].next)
        if (i >= x->used || x->E[i].n || ++free_count > x->used) return 9;
    if (free_count + x->live != x->used) return 9;
    return 0;
}

/* ---- the Python type ------------------------------------------------------------------- */

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
    PyObject *intern;  /* intern(name) -> id: the index's, for a name with no id yet */
    PyObject *as_keys; /* as_keys(query, extra_key, cache_salt) -> page keys of token ids */
    PyObject **names; /* id -> instance name (set_name), NULL when free */
    Py_ssize_t names_cap;
    PyObject **uniform; /* [tier * UNIFORM_RUNS + run]: (rank[tier],) * run, made on first use */
    int64_t *spec;      /* (kind, tier bits, key count) per event of a batch */
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
        memcpy(x->gathered + i * kl, PyBytes_AS_STRING(o), (size_t)kl);
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
        memcpy(x->gathered + (at + i) * kl, PyBytes_AS_STRING(o), (size_t)kl);
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

/* apply(instance, events): PrefixIndex.apply. Validates the instance name and every event
   (raising, before any change, InvalidInstance / InvalidEvent as the Python core does); a name
   with no id yet is interned (`intern`, then validated again: the callback may run any
   Python code); then the batch is applied in one go. MemoryError when memory runs out
   mid-batch (applied in part, every structure consistent). */
static PyObject *Core_apply(CoreObject *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "apply(instance, events)");
        return NULL;
    }
    PyObject *instance = args[0];
    if (check_instance(c, instance)) return NULL;
    PyObject *seq = PySequence_Fast(args[1], "events must be iterable");
    if (!seq) return NULL;
    ix_t *x = c->x;
    Py_ssize_t ne = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *result = NULL;
    if (3 * ne > c->spec_cap) {
        Py_ssize_t cap = 2 * 3 * ne;
        int64_t *spec = (int64_t *)PyMem_Realloc(c->spec, (size_t)cap * sizeof(int64_t));
        if (!spec) {
            PyErr_NoMemory();
            goto done;
        }
        c->spec = spec;
        c->spec_cap = cap;
    }
    int interned = 0;
again:;
    int64_t keys = 0;
    for (Py_ssize_t i = 0; i < ne; i++) {
        if (take_event(c, items[i], c->spec + 3 * i, keys)) goto done;
        keys += c->spec[3 * i + 2];
    }
    PyObject *id = PyDict_GetItemWithError(c->ids, instance);
    if (!id) {
        if (PyErr_Occurred()) goto done;
        if (interned || !c->intern) {
            PyErr_Format(PyExc_LookupError, "instance %R has no id", instance);
            goto done;
        }
        PyObject *got = PyObject_CallOneArg(c->intern, instance);
        if (!got) goto done;
        Py_DECREF(got);
        interned = 1;
        goto again;
    }
    long iid = PyLong_AsLong(id);
    if (iid < 0 || iid >= MAX_IID) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "instance id %ld out of range", iid);
        goto done;
    }
    if (ne && ix_apply(x, iid, c->spec, ne, x->gathered) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    shrink(x);
    Py_DECREF(seq);
    return result;
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
    return c->names[iid];
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
    for (int64_t j = 0; j < got; j++) {
        int32_t run = x->res[3 * j + 1], tier = x->res[3 * j + 2];
        PyObject *name = name_of(c, x->res[3 * j]);
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
    }
    PyObject *num = PyLong_FromSsize_t(num_pages);
    if (!num) goto fail;
    PyObject *three[3] = {num, by, Py_NewRef(Py_False)};
    return new_named(c->matches_type, 3, three);
fail:
    Py_DECREF(by);
    return NULL;
}

/* The PrefixMatches of `query`, a list / tuple: its keys up to the first that is no bytes of
   key_len (no entry can have it) are matched; num_pages is its length, as in the Python core. */
static PyObject *find_keys(CoreObject *c, PyObject *query) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(query);
    ix_t *x = c->x;
    int64_t m = gather_prefix(x, PySequence_Fast_ITEMS(query), n);
    int64_t got = m > 0 ? run_match(x, m, 1) : m;
    shrink(x);
    return got < 0 ? NULL : matches(c, n, got);
}

/* find_matches(query, *, extra_key=None, cache_salt=None): PrefixIndex.find_matches. A list /
   tuple that is empty or opens with a bytes object is page keys; anything else is token ids,
   keyed by `as_keys` (the index's keyer, in the namespace given). */
static PyObject *Core_find_matches(CoreObject *c, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames) {
    PyObject *extra_key = Py_None, *cache_salt = Py_None;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "find_matches(query, *, extra_key=None, cache_salt=None)");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *k = PyTuple_GET_ITEM(kwnames, i);
        if (PyUnicode_Compare(k, s_extra_key) == 0) extra_key = args[1 + i];
        else if (PyUnicode_Compare(k, s_cache_salt) == 0) cache_salt = args[1 + i];
        else {
            PyErr_Format(PyExc_TypeError, "find_matches() got an unexpected keyword argument %R", k);
            return NULL;
        }
    }
    PyObject *query = args[0];
    if ((PyList_Check(query) || PyTuple_Check(query)) &&
        (!PySequence_Fast_GET_SIZE(query) || PyBytes_Check(PySequence_Fast_ITEMS(query)[0])))
        return find_keys(c, query);
    if (!c->as_keys) {
        PyErr_SetString(PyExc_TypeError, "this core keys no token ids: pass page keys");
        return NULL;
    }
    PyObject *keys = PyObject_CallFunctionObjArgs(c->as_keys, query, extra_key, cache_salt, NULL);
    if (!keys) return NULL;
    PyObject *out = NULL;
    if (PyList_Check(keys) || PyTuple_Check(keys)) out = find_keys(c, keys);
    else PyErr_SetString(PyExc_TypeError, "as_keys must return a list or tuple of page keys");
    Py_DECREF(keys);
    return out;
}

/* lengths(keys) -> {name: pages matched}: the routing lookup, no tiers. */
static PyObject *Core_lengths(CoreObject *c, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "page keys must be a sequence");
    if (!seq) return NULL;
    ix_t *x = c->x;
    int64_t m = gather_prefix(x, PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq));
    Py_DECREF(seq);
    int64_t got = m > 0 ? run_match(x, m, 0) : m;
    shrink(x);
    if (got < 0) return NULL;
    PyObject *out = PyDict_New();
    for (int64_t j = 0; out && j < got; j++) {
        PyObject *name = name_of(c, x->res[3 * j]);
        PyObject *run = name ? PyLong_FromLong(x->res[3 * j + 1]) : NULL;
        if (!run || PyDict_SetItem(out, name, run)) Py_CLEAR(out);
        Py_XDECREF(run);
    }
    return out;
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

/* set_name(id, name | None): the name results give instance `id` (None: the id is free). */
static PyObject *Core_set_name(CoreObject *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_name(id, name)");
        return NULL;
    }
    long iid = iid_arg(args[0]);
    if (iid < 0) return NULL;
    if (args[1] != Py_None && check_instance(c, args[1])) return NULL;
    if (iid >= c->names_cap) {
        Py_ssize_t cap = c->names_cap ? c->names_cap : 16;
        while (cap <= iid) cap *= 2;
        PyObject **names = (PyObject **)PyMem_Realloc(c->names, (size_t)cap * sizeof(PyObject *));
        if (!names) return PyErr_NoMemory();
        memset(names + c->names_cap, 0, (size_t)(cap - c->names_cap) * sizeof(PyObject *));
        c->names = names;
        c->names_cap = cap;
    }
    PyObject *old = c->names[iid];
    c->names[iid] = args[1] == Py_None ? NULL : Py_NewRef(args[1]);
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

/* drop(id) -> keys it held: every key of instance `id` goes. */
static PyObject *Core_drop(CoreObject *c, PyObject *arg) {
    long iid = iid_arg(arg);
    if (iid < 0) return NULL;
    return PyLong_FromLongLong(clear(c->x, (uint32_t)iid, (uint32_t)c->x->all_tiers));
}

static PyObject *Core_held(CoreObject *c, PyObject *arg) {
    long iid = iid_arg(arg);
    if (iid < 0) return NULL;
    return PyLong_FromLongLong(ix_held(c->x, iid));
}

/* holdings(id) -> [(key, tier bits)] of instance `id`. */
static PyObject *Core_holdings(CoreObject *c, PyObject *arg) {
    long iid = iid_arg(arg);
    if (iid < 0) return NULL;
    ix_t *x = c->x;
    int64_t held = ix_held(x, iid);
    PyObject *out = PyList_New((Py_ssize_t)held);
    for (int64_t p = 0; out && p < held; p++) {
        entry_t *e = &x->E[x->I[iid].k[p]];
        holder_t *h = holders(e);
        PyObject *pair = Py_BuildValue("(y#I)", (const char *)e->key, (Py_ssize_t)x->key_len,
                                       (unsigned)h[lower(h, e->n, (uint32_t)iid)].tiers);
        if (!pair) Py_CLEAR(out);
        else PyList_SET_ITEM(out, p, pair);
    }
    return out;
}

/* stats() -> (entries, pairs, evicted entries, bytes allocated by the C side). */
static PyObject *Core_stats(CoreObject *c, PyObject *Py_UNUSED(ignored)) {
    int64_t s[4];
    ix_stats(c->x, s);
    s[3] += (int64_t)sizeof(CoreObject) + c->names_cap * (int64_t)sizeof(PyObject *) +
            c->spec_cap * 8 + PyTuple_GET_SIZE(c->rank) * UNIFORM_RUNS * (int64_t)sizeof(PyObject *);
    return Py_BuildValue("(LLLL)", (long long)s[0], (long long)s[1], (long long)s[2],
                         (long long)s[3]);
}

/* check() -> 0 when every invariant of the C structures holds, else the first broken one. */
static PyObject *Core_check(CoreObject *c, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLongLong(ix_check(c->x));
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

/* hashes(keys) -> [64-bit hash of each key] (tests: keys whose slot bits collide). */
static PyObject *Core_hashes(CoreObject *c, PyObject *keys) {
    ix_t *x = c->x;
    int64_t n = gather_all(x, keys);
    if (n < 0) return NULL;
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (int64_t i = 0; out && i < n; i++) {
        PyObject *h = PyLong_FromUnsignedLongLong(key_hash(x, x->gathered + i * x->key_len));
        if (!h) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, h);
    }
    shrink(x);
    return out;
}

/* match_count(keys) -> instances matched: the lookup without names or result objects
   (opstream.native_floor: what the index cannot go below). */
static PyObject *Core_match_count(CoreObject *c, PyObject *keys) {
    int64_t n = gather_all(c->x, keys);
    int64_t got = n > 0 ? run_match(c->x, n, 1) : n;
    shrink(c->x);
    return got < 0 ? NULL : PyLong_FromLongLong(got);
}

/* apply_keys(id, kind, bits, keys): one store (kind 0) or removal (1) of `keys` on tier `bits`
   for instance `id`, without events or names (opstream.native_floor). */
static PyObject *Core_apply_keys(CoreObject *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "apply_keys(id, kind, bits, keys)");
        return NULL;
    }
    ix_t *x = c->x;
    long iid = iid_arg(args[0]);
    if (iid < 0) return NULL;
    long kind = PyLong_AsLong(args[1]), bits = PyLong_AsLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    if ((kind != 0 && kind != 1) || bits <= 0 || (bits & ~x->all_tiers)) {
        PyErr_Format(PyExc_ValueError, "kind 0 or 1 and tier bits in %lld, got %ld, %ld",
                     (long long)x->all_tiers, kind, bits);
        return NULL;
    }
    int64_t n = gather_all(x, args[3]);
    if (n < 0) return NULL;
    int64_t spec[3] = {kind, bits, n};
    int64_t rc = ix_apply(x, iid, spec, 1, x->gathered);
    shrink(x);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* fail_allocation(after) -> the setting replaced: tests only; the C allocation after `after`
   more that succeed fails, once (-1: none). One setting for the whole process. */
static PyObject *Core_fail_allocation(CoreObject *Py_UNUSED(c), PyObject *arg) {
    long long after = PyLong_AsLongLong(arg);
    if (after == -1 && PyErr_Occurred()) return NULL;
    int64_t was = fail_after;
    fail_after = after < 0 ? -1 : after;
    return PyLong_FromLongLong(was);
}

static int named_tuple_type(PyTypeObject *t) {
    return PyType_IsSubtype(t, &PyTuple_Type) && t->tp_basicsize == PyTuple_Type.tp_basicsize &&
           t->tp_itemsize == PyTuple_Type.tp_itemsize && !t->tp_dictoffset;
}

/* Core(key_len, page_size, max_entries, tier_bit, rank, known, ids,
        (BlockStored, BlockRemoved, AllBlocksCleared, PrefixMatches, InstanceMatch),
        (InvalidEvent, InvalidInstance), intern | None, as_keys | None) */
static PyObject *Core_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Py_ssize_t key_len, max_entries;
    PyObject *page_size, *tier_bit, *rank, *known, *ids, *invalid_event, *invalid_instance;
    PyObject *intern, *as_keys;
    PyTypeObject *stored, *removed, *cleared, *matches_type, *match_type;
    if (kwds && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Core takes positional arguments only");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "nO!nO!O!UO!(O!O!O!O!O!)(OO)OO:Core", &key_len, &PyLong_Type,
                          &page_size, &max_entries, &PyDict_Type, &tier_bit, &PyTuple_Type, &rank,
                          &known, &PyDict_Type, &ids, &PyType_Type, &stored, &PyType_Type,
                          &removed, &PyType_Type, &cleared, &PyType_Type, &matches_type,
                          &PyType_Type, &match_type, &invalid_event, &invalid_instance, &intern,
                          &as_keys))
        return NULL;
    Py_ssize_t tiers = PyTuple_GET_SIZE(rank);
    if (!named_tuple_type(matches_type) || !named_tuple_type(match_type)) {
        PyErr_SetString(PyExc_TypeError, "result types must be plain tuple subclasses");
        return NULL;
    }
    if (PyDict_GET_SIZE(tier_bit) != tiers || tiers < 1 || tiers > 31) {
        PyErr_SetString(PyExc_ValueError, "tier_bit and rank must name the same 1..31 tiers");
        return NULL;
    }
    for (Py_ssize_t t = 0; t < tiers; t++) {
        PyObject *bit = PyDict_GetItemWithError(tier_bit, PyTuple_GET_ITEM(rank, t));
        if (!bit || PyLong_AsLongLong(bit) != (1LL << t)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "tier_bit[rank[t]] must be 1 << t");
            return NULL;
        }
    }
    if (!PyExceptionClass_Check(invalid_event) || !PyExceptionClass_Check(invalid_instance)) {
        PyErr_SetString(PyExc_TypeError, "errors must be exception classes");
        return NULL;
    }
    CoreObject *c = (CoreObject *)type->tp_alloc(type, 0);
    if (!c) return NULL;
    c->x = ix_new(key_len, tiers, max_entries > 0 ? max_entries : 0);
    c->uniform = (PyObject **)PyMem_Calloc((size_t)(tiers * UNIFORM_RUNS), sizeof(PyObject *));
    if (c->x) {
        c->x->res = (int32_t *)malloc(3 * 64 * sizeof(int32_t));
        c->x->pages = (uint8_t *)malloc(4096);
        c->x->res_cap = c->x->res ? 3 * 64 : 0;
        c->x->page_cap = c->x->pages ? 4096 : 0;
    }
    c->page_size = Py_NewRef(page_size);
    c->ids = Py_NewRef(ids);
    c->tier_bit = Py_NewRef(tier_bit);
    c->rank = Py_NewRef(rank);
    c->known = Py_NewRef(known);
    c->stored = (PyTypeObject *)Py_NewRef(stored);
    c->removed = (PyTypeObject *)Py_NewRef(removed);
    c->cleared = (PyTypeObject *)Py_NewRef(cleared);
    c->matches_type = (PyTypeObject *)Py_NewRef(matches_type);
    c->match_type = (PyTypeObject *)Py_NewRef(match_type);
    c->invalid_event = Py_NewRef(invalid_event);
    c->invalid_instance = Py_NewRef(invalid_instance);
    c->intern = intern == Py_None ? NULL : Py_NewRef(intern);
    c->as_keys = as_keys == Py_None ? NULL : Py_NewRef(as_keys);
    if (!c->x || !c->uniform || !c->x->res || !c->x->pages) {
        Py_DECREF(c);
        if (key_len < 1 || key_len > KEY_MAX)
            PyErr_Format(PyExc_ValueError, "key_len must be 1..%d", KEY_MAX);
        else
            PyErr_NoMemory();
        return NULL;
    }
    return (PyObject *)c;
}

/* The callbacks are the index's bound methods, and the index holds this core: a cycle the
   garbage collector must see. */
static int Core_traverse(CoreObject *c, visitproc visit, void *arg) {
    Py_VISIT(c->intern);
    Py_VISIT(c->as_keys);
    Py_VISIT(c->ids);
    return 0;
}

static int Core_clear(CoreObject *c) {
    Py_CLEAR(c->intern);
    Py_CLEAR(c->as_keys);
    return 0;
}

static void Core_dealloc(CoreObject *c) {
    PyObject_GC_UnTrack(c);
    Core_clear(c);
    ix_free(c->x);
    for (Py_ssize_t i = 0; i < c->names_cap; i++) Py_XDECREF(c->names[i]);
    PyMem_Free(c->names);
    if (c->uniform && c->rank)
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(c->rank) * UNIFORM_RUNS; i++)
            Py_XDECREF(c->uniform[i]);
    PyMem_Free(c->uniform);
    PyMem_Free(c->spec);
    Py_XDECREF(c->page_size);
    Py_XDECREF(c->ids);
    Py_XDECREF(c->tier_bit);
    Py_XDECREF(c->rank);
    Py_XDECREF(c->known);
    Py_XDECREF(c->stored);
    Py_XDECREF(c->removed);
    Py_XDECREF(c->cleared);
    Py_XDECREF(c->matches_type);
    Py_XDECREF(c->match_type);
    Py_XDECREF(c->invalid_event);
    Py_XDECREF(c->invalid_instance);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyMethodDef Core_methods[] = {
    {"apply", (PyCFunction)(void (*)(void))Core_apply, METH_FASTCALL, NULL},
    {"find_matches", (PyCFunction)(void (*)(void))Core_find_matches,
     METH_FASTCALL | METH_KEYWORDS, NULL},
    {"lengths", (PyCFunction)Core_lengths, METH_O, NULL},
    {"set_name", (PyCFunction)(void (*)(void))Core_set_name, METH_FASTCALL, NULL},
    {"drop", (PyCFunction)Core_drop, METH_O, NULL},
    {"held", (PyCFunction)Core_held, METH_O, NULL},
    {"holdings", (PyCFunction)Core_holdings, METH_O, NULL},
    {"stats", (PyCFunction)Core_stats, METH_NOARGS, NULL},
    {"check", (PyCFunction)Core_check, METH_NOARGS, NULL},
    {"hashes", (PyCFunction)Core_hashes, METH_O, NULL},
    {"match_count", (PyCFunction)Core_match_count, METH_O, NULL},
    {"apply_keys", (PyCFunction)(void (*)(void))Core_apply_keys, METH_FASTCALL, NULL},
    {"fail_allocation", (PyCFunction)Core_fail_allocation, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstrata_prefix_index_core.Core",
    .tp_basicsize = sizeof(CoreObject),
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)Core_traverse,
    .tp_clear = (inquiry)Core_clear,
    .tp_free = PyObject_GC_Del,
    .tp_doc = "One prefix index's entries (see index_ext.c).",
    .tp_methods = Core_methods,
    .tp_new = Core_new,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvstrata_prefix_index_core",
    .m_doc = "The prefix index's compiled core (kvstrata.prefix_index.native).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit_kvstrata_prefix_index_core(void) {
    s_page_keys = PyUnicode_InternFromString("page_keys");
    s_tier = PyUnicode_InternFromString("tier");
    s_tokens_per_page = PyUnicode_InternFromString("tokens_per_page");
    s_extra_key = PyUnicode_InternFromString("extra_key");
    s_cache_salt = PyUnicode_InternFromString("cache_salt");
    if (!s_page_keys || !s_tier || !s_tokens_per_page || !s_extra_key || !s_cache_salt ||
        PyType_Ready(&CoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
