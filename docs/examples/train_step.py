"""A data-parallel training step with synkhronos.extensions (logistic regression)."""
import numpy as np
import pytensor as theano
import pytensor.tensor as T
import synkhronos as synk
from synkhronos.extensions import train, updates

synk.fork(2)
rng = np.random.default_rng(0)
x = T.matrix('x', dtype='float32')
y = T.vector('y', dtype='float32')
W = theano.shared(np.zeros(5, dtype='float32'), name='W')
b = theano.shared(np.zeros((), dtype='float32'), name='b')
p = T.sigmoid(x.dot(W) + b)
loss = -T.mean(y * T.log(p) + (1 - y) * T.log(1 - p))

step = train.make_train_function(loss, [W, b], [x, y], updates.adam, learning_rate=0.1)
synk.distribute()

X = rng.standard_normal((1000, 5)).astype('float32')
Y = (X @ np.arange(5, dtype='float32') > 0).astype('float32')
X_synk, Y_synk = synk.data(X), synk.data(Y)

for epoch in range(20):
    for idx in np.split(rng.permutation(1000), 10):     # minibatches of 100 rows
        loss_value = step(X_synk, Y_synk, batch=idx)
print("final minibatch loss below 0.2:", float(loss_value) < 0.2)
print("parameters equal on every rank:", np.all(synk.gather(W)[0] == synk.gather(W)[1]))
