import numpy as np
import pytensor as theano
import pytensor.tensor as T
import synkhronos as synk

synk.fork()                       # start worker processes
x = T.matrix('x')
y = T.vector('y')
z = T.mean(x.dot(y), axis=0)

f_th = theano.function(inputs=[x, y], outputs=z)
f = synk.function(inputs=[x], bcast_inputs=[y], outputs=z)
synk.distribute()                 # send functions to the workers

x_dat = np.random.randn(100, 10).astype(theano.config.floatX)
y_dat = np.random.randn(10).astype(theano.config.floatX)
x_synk = synk.data(x_dat)         # data in shared memory
y_synk = synk.data(y_dat)
r_th = f_th(x_dat, y_dat)
r = f(x_synk, y_synk)

assert np.allclose(r, r_th)
print("All assertions passed.")
