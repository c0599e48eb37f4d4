"""More collectives (2 ranks): unequal shapes, integer averages, one rank at a time."""
import numpy as np
import pytensor as theano
import synkhronos as synk

synk.fork(2)
v = theano.shared(np.zeros(2), name='v')
k = theano.shared(np.zeros(3, dtype='int64'), name='k')
f = synk.function([], updates=[(v, v + 1), (k, k + 1)])    # the collectives need a function
synk.distribute()

synk.scatter(v, np.arange(5.))          # rank 0 gets [0, 1], rank 1 gets [2, 3, 4]
print(synk.get_lengths(v), synk.get_shapes(v))
print(synk.gather(v))                   # shapes differ: a list of per-rank arrays
print(synk.gather(v, nd_up=0))          # concatenated along axis 0
synk.all_gather(v)                      # every rank now holds all 5 values
print(synk.get_value(1, v))

synk.set_value(0, k, [1, 2, 3])         # one rank at a time, the master included
synk.set_value(1, k, [2, 2, 4])
print(synk.reduce(k, op="avg", in_place=False), k.get_value())   # master untouched
synk.all_reduce(k, op="avg")            # mean of 1,2 / 2,2 / 3,4, rounded half to even
print(synk.gather(k))

synk.set_value(1, v, [1., 2.])          # now 5 values on rank 0, 2 on rank 1
try:
    synk.all_reduce(v)
except ValueError as e:
    print("ValueError:", str(e).split(",")[0])
synk.broadcast(v)                       # the master's value everywhere
print(synk.gather(v, nd_up=1).shape)
