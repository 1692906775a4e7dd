"""A tiny reverse-mode automatic differentiation over NumPy float64.

The references write only the forward maths of docs/maths.md with these operations;
gradients then follow mechanically, so a reference's backward can never
disagree with its own forward. Central finite differences (`fd_grad`) check the
operations themselves in tests/test_reference.py.

Usage:
    x = Var(np.random.rand(3, 4)); W = Var(np.random.rand(4, 2))
    loss = (x @ W).tanh().sum()
    loss.backward()            # x.grad, W.grad now hold d loss / d x, d W
"""
import numpy as np


def _unbroadcast(g, shape):
    """Sum g down to `shape`, undoing NumPy broadcasting."""
    while g.ndim > len(shape):
        g = g.sum(axis=0)
    for i, n in enumerate(shape):
        if n == 1 and g.shape[i] != 1:
            g = g.sum(axis=i, keepdims=True)
    return g


def _val(x):
    return x if isinstance(x, Var) else Var(np.asarray(x, dtype=np.float64), requires_grad=False)


class Var:
    """A float64 array that records how it was computed."""

    __array_priority__ = 100.0

    def __init__(self, value, parents=(), grad_fns=(), requires_grad=True):
        self.value = np.asarray(value, dtype=np.float64)
        self.parents = parents
        self.grad_fns = grad_fns
        self.requires_grad = requires_grad or any(p.requires_grad for p in parents)
        self.grad = None

    @property
    def shape(self):
        return self.value.shape

    @property
    def ndim(self):
        return self.value.ndim

    def _make(self, value, parents, grad_fns):
        return Var(value, tuple(parents), tuple(grad_fns), requires_grad=False)

    # -- elementwise arithmetic, with broadcasting
    def __add__(self, o):
        o = _val(o)
        return self._make(self.value + o.value, (self, o),
                          (lambda g: _unbroadcast(g, self.shape),
                           lambda g: _unbroadcast(g, o.shape)))

    __radd__ = __add__

    def __sub__(self, o):
        o = _val(o)
        return self._make(self.value - o.value, (self, o),
                          (lambda g: _unbroadcast(g, self.shape),
                           lambda g: -_unbroadcast(g, o.shape)))

    def __rsub__(self, o):
        return _val(o) - self

    def __mul__(self, o):
        o = _val(o)
        a, b = self.value, o.value
        return self._make(a * b, (self, o),
                          (lambda g: _unbroadcast(g * b, a.shape),
                           lambda g: _unbroadcast(g * a, b.shape)))

    __rmul__ = __mul__

    def __truediv__(self, o):
        o = _val(o)
        a, b = self.value, o.value
        return self._make(a / b, (self, o),
                          (lambda g: _unbroadcast(g / b, a.shape),
                           lambda g: _unbroadcast(-g * a / (b * b), b.shape)))

    def __rtruediv__(self, o):
        return _val(o) / self

    def __neg__(self):
        return self * -1.0

    def __matmul__(self, o):
        """(..., K) @ (K, M) -> (..., M): a row vector times an [in,out] matrix."""
        o = _val(o)
        a, b = self.value, o.value
        assert b.ndim == 2
        return self._make(a @ b, (self, o),
                          (lambda g: g @ b.T,
                           lambda g: a.reshape(-1, a.shape[-1]).T @ g.reshape(-1, g.shape[-1])))

    @property
    def T(self):
        """The transpose of a matrix."""
        assert self.ndim == 2
        return self._make(self.value.T, (self,), (lambda g: g.T,))

    # -- unary functions
    def _unary(self, value, dfdx):
        return self._make(value, (self,), (lambda g: g * dfdx,))

    def exp(self):
        e = np.exp(self.value)
        return self._unary(e, e)

    def log(self):
        return self._unary(np.log(self.value), 1.0 / self.value)

    def tanh(self):
        t = np.tanh(self.value)
        return self._unary(t, 1.0 - t * t)

    def sigmoid(self):
        s = 1.0 / (1.0 + np.exp(-self.value))
        return self._unary(s, s * (1.0 - s))

    def relu(self):
        return self._unary(np.maximum(self.value, 0.0), (self.value > 0).astype(np.float64))

    def sqrt(self):
        s = np.sqrt(self.value)
        return self._unary(s, 0.5 / s)

    def square(self):
        return self._unary(self.value ** 2, 2.0 * self.value)

    def maximum(self, floor):
        """max(self, floor) for a constant floor; the grad flows where self wins."""
        return self._unary(np.maximum(self.value, floor), (self.value >= floor).astype(np.float64))

    # -- reductions and shape
    def sum(self, axis=None, keepdims=False):
        shape = self.shape

        def back(g):
            if axis is not None and not keepdims:
                g = np.expand_dims(g, axis)
            return np.broadcast_to(g, shape)
        return self._make(self.value.sum(axis=axis, keepdims=keepdims), (self,), (back,))

    def mean(self, axis=None, keepdims=False):
        n = (self.value.size if axis is None
             else np.prod([self.shape[a] for a in np.atleast_1d(axis)]))
        return self.sum(axis, keepdims) * (1.0 / n)

    def reshape(self, *shape):
        old = self.shape
        return self._make(self.value.reshape(*shape), (self,), (lambda g: g.reshape(old),))

    def __getitem__(self, idx):
        shape = self.shape

        def back(g):
            out = np.zeros(shape)
            np.add.at(out, idx, g)
            return out
        return self._make(self.value[idx], (self,), (back,))

    def where(self, mask, other):
        """self where mask else the constant `other` (no grad to other)."""
        mask = np.asarray(mask, dtype=bool)
        return self._make(np.where(mask, self.value, other), (self,), (lambda g: g * mask,))

    # -- reverse sweep
    def backward(self, grad=None):
        order, seen = [], set()

        def visit(v):
            stack = [(v, False)]
            while stack:
                node, done = stack.pop()
                if done:
                    order.append(node)
                    continue
                if id(node) in seen:
                    continue
                seen.add(id(node))
                stack.append((node, True))
                for p in node.parents:
                    if p.requires_grad and id(p) not in seen:
                        stack.append((p, False))
        visit(self)
        grads = {id(self): np.ones(self.shape) if grad is None else np.asarray(grad, np.float64)}
        for node in reversed(order):
            g = grads.pop(id(node), None)
            if g is None:
                continue
            if not node.parents:
                node.grad = g if node.grad is None else node.grad + g
                continue
            for p, fn in zip(node.parents, node.grad_fns):
                if p.requires_grad:
                    pg = fn(g)
                    grads[id(p)] = grads[id(p)] + pg if id(p) in grads else pg


def concat(vs, axis=0):
    """Concatenate Vars (or constants) along axis."""
    vs = [_val(v) for v in vs]
    sizes = np.cumsum([v.shape[axis] for v in vs])[:-1]

    def make_back(i):
        return lambda g: np.split(g, sizes, axis=axis)[i]
    return Var(np.concatenate([v.value for v in vs], axis=axis), tuple(vs),
               tuple(make_back(i) for i in range(len(vs))), requires_grad=False)


def stack(vs, axis=0):
    vs = [_val(v) for v in vs]
    return concat([v.reshape(*v.shape[:axis], 1, *v.shape[axis:]) for v in vs], axis=axis)


def leaf(x):
    """A differentiable input: a float64 copy of x."""
    return Var(np.array(x, dtype=np.float64))


def fd_grad(f, inputs, i, idx, eps=1e-6):
    """Central finite difference of the scalar f(*inputs) w.r.t. inputs[i][idx]
    (inputs are float64 arrays; f returns a float)."""
    plus = [np.array(x, dtype=np.float64) for x in inputs]
    minus = [np.array(x, dtype=np.float64) for x in inputs]
    plus[i][idx] += eps
    minus[i][idx] -= eps
    return (f(*plus) - f(*minus)) / (2.0 * eps)
