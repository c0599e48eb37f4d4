"""Examples of the data-patterns page (run with 2 ranks; prints what the page shows)."""
import numpy as np
import pytensor as theano
import pytensor.tensor as T
import synkhronos as synk

synk.fork(2)

# --- one function, several reduce modes ------------------------------------------------
x = T.matrix('x')
f = synk.function(inputs=[x],
                  outputs=[T.mean(x),               # avg (the default)
                           (T.sum(x), 'sum'),
                           (T.max(x), 'max'),
                           (x.shape[0], 'gather'),  # each rank's number of rows
                           (x.shape[0], None)])     # the master's own result only

# --- updates, local to each rank, accumulated over slices ------------------------------
s = theano.shared(np.zeros(3), name='s')
c = theano.shared(np.zeros(3), name='c')
g = synk.function(inputs=[x], updates=[(s, T.mean(x, axis=0)),          # avg
                                       (c, c + T.sum(x, axis=0), 'sum')])

# --- a data set kept in shared variables: sliceable_shareds + batch_s ------------------
X_s = theano.shared(np.zeros((0, 3)), name='X_s')
h = synk.function(inputs=[], outputs=(T.sum(x), 'sum'),
                  givens=[(x, X_s)], sliceable_shareds=[X_s])

# --- a full data set and a per-batch minibatch input --------------------------------------
y = T.vector('y')
k = synk.function(inputs=[x, y], outputs=(T.sum(x.sum(axis=1) * y), 'sum'))

synk.distribute()

X = np.arange(15, dtype='float64').reshape(5, 3)     # 5 rows: rank 0 gets 2, rank 1 gets 3
X_synk = synk.data(X)

mean, total, biggest, rows, master_rows = f(X_synk)
print(mean, X.mean())            # the true mean, although the shards are unequal
print(total, biggest)
print(rows, master_rows)

print(f(X_synk, batch=4)[3])                 # rows 0..3
print(f(X_synk, batch=slice(1, 4))[3])       # rows 1..3
print(f(X_synk, batch=[4, 0, 2])[0], X[[4, 0, 2]].mean())
print([float(v) for v in f(X, output_subset=[1, 0])])  # numpy input; outputs 1 and 0

g(X_synk, num_slices=2)                      # each rank: its rows in up to 2 pieces
print(synk.gather(s, nd_up=1))               # rank 0: mean of rows 0-1, rank 1: of rows 2-4
print(synk.gather(c, nd_up=1))               # the sums of each rank's rows

synk.scatter(X_s, X)                         # rank 0 holds rows 0-1, rank 1 rows 2-4
print(synk.get_lengths(X_s))
print(h(), h(batch_s=slice(0, 2)), h(batch_s=[[1], [0, 2]]))

idx = np.array([3, 1, 4, 0])
y_mb = synk.data(np.array([1., 10., 100., 1000.]), minibatch=True)  # one weight per batch row
print(k(X_synk, y_mb, batch=idx), (X[idx].sum(axis=1) * y_mb.data).sum())
