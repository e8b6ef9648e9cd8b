"""The higher-order workloads of bench/workloads.md for the peers (torch eager,
torch.compile, JAX jit).

The Python twin of test/support/higher_order.hpp: the same tensors from the same formula,
the same losses. Readings of the specification where it leaves a choice are those of the
C++ twin:

- every tensor a workload lists takes a number t, also those not from the formula (hvp's
  labels y; maml's y_s and y_q), so hvp's v_i are t = n_w + 2 + i and maml's x_q is
  t = n_w + 2;
- a bias has shape [fan_out];
- the small sizes shrink the widths only where the table says so (burgers, kdv, poisson, poisson128,
  forces_silu, critic*, hvp); burgers_residual, forces_softplus and maml keep theirs;
- burgers_residual lists only X (t = n_w);
- the critic's x_hat = e * real + (1 - e) * fake is formed once when the tensors are built
  (in the dtype) and is an input the penalty differentiates in; the penalty's norm has no
  epsilon.

This module imports only numpy at import time; `torch_step` and `jax_step` import their
framework when called.
"""

import math

import numpy as np

NAMES = ["burgers", "burgers_residual", "kdv", "poisson", "poisson128", "forces_silu", "forces_softplus",
         "critic128", "critic512", "hvp", "maml"]

BURGERS_NU = 0.01 / math.pi


# ---------------------------------------------------------------------------- values

def formula(shape, scale, t):
    """Tensor number t: value[k] = scale * sin(0.731 k + 1.37 t + 0.1), in double."""
    n = int(np.prod(shape, dtype=np.int64))
    k = np.arange(n, dtype=np.float64)
    return (scale * np.sin(0.731 * k + 1.37 * float(t) + 0.1)).reshape(shape)


def mlp_layers(inp, width, hidden, out):
    return [inp] + [width] * hidden + [out]


class Spec:
    """One workload at one dtype and size: its weights W1, b1, W2, b2, ... and data as
    numpy arrays in the workload's dtype (labels int64), and which data the loss
    differentiates in (`data_grad`)."""

    def __init__(self, name, dtype, small, derivatives, act, layers):
        self.name = name
        self.dtype = np.dtype(dtype)
        self.small = small
        self.derivatives = derivatives
        self.act = act
        self.layers = layers
        self.weights = []
        for i in range(len(layers) - 1):
            t = len(self.weights)
            self.weights.append(formula([layers[i], layers[i + 1]], 1.0 / math.sqrt(layers[i]), t)
                                .astype(self.dtype))
            self.weights.append(formula([layers[i + 1]], 0.1, t + 1).astype(self.dtype))
        self.data = []
        self.data_grad = []
        self._listed = 0
        self.sizes = ""

    def next_t(self):
        return len(self.weights) + self._listed

    def count_listed(self, n=1):
        self._listed += n

    def add_data(self, a, grad=False):
        self.data.append(np.ascontiguousarray(a))
        self.data_grad.append(grad)

    def add_listed(self, shape, grad=False):
        """Appends the next listed tensor (the specification's values at scale 1, in the
        workload's dtype) as data and counts it."""
        self.add_data(formula(shape, 1, self.next_t()).astype(self.dtype), grad)
        self.count_listed()

    def describe(self):
        act = {"tanh": "tanh", "silu": "SiLU", "softplus": "softplus",
               "leaky_relu": "leaky ReLU 0.2"}[self.act]
        return "-".join(str(v) for v in self.layers) + " " + act + ", N " + self.sizes


def make_spec(name, dtype, small):
    """The workload `name` at `dtype` ("float" / "double" or a numpy dtype), default or
    small sizes. ValueError for an unknown name."""
    if dtype in ("float", "float32"):
        dtype = np.float32
    elif dtype in ("double", "float64"):
        dtype = np.float64
    dt = np.dtype(dtype)
    if name in ("burgers", "burgers_residual"):
        boundary = name == "burgers"
        s = Spec(name, dt, small, 3, "tanh", mlp_layers(2, 8 if (small and boundary) else 20, 8, 1))
        n, nb = (64, 8) if small else (10000, 100)
        s.add_listed([n, 2], True)
        if boundary:
            s.add_listed([nb, 2])
            s.add_listed([nb, 1])
        s.sizes = "%d + %d" % (n, nb) if boundary else "%d" % n
        return s
    if name in ("kdv", "poisson", "poisson128"):
        # kdv: X, X_b, g_b; poisson, poisson128: X, the source s [N, 1], X_b, g_b.
        poisson = name != "kdv"
        wide = name == "poisson128"
        width = (80 if small else 128) if wide else (8 if small else (50 if poisson else 32))
        s = Spec(name, dt, small, 3 if poisson else 4, "tanh",
                 mlp_layers(2, width, 3 if poisson else 4, 1))
        n, nb = (64, 8) if small else ((2000, 200) if wide else (4000, 400 if poisson else 100))
        s.add_listed([n, 2], True)
        if poisson:
            s.add_listed([n, 1])
        s.add_listed([nb, 2])
        s.add_listed([nb, 1])
        s.sizes = "%d + %d" % (n, nb)
        return s
    if name in ("forces_silu", "forces_softplus"):
        softplus = name == "forces_softplus"
        s = Spec(name, dt, small, 2, "softplus" if softplus else "silu",
                 mlp_layers(12, 16 if (small and not softplus) else 64, 2, 1))
        n = 32 if small else 2000
        s.add_listed([n, 12], True)
        s.add_listed([n, 1])
        s.add_listed([n, 12])
        s.sizes = "%d" % n
        return s
    if name in ("critic128", "critic512"):
        width = 128 if name == "critic128" else 512
        s = Spec(name, dt, small, 2, "leaky_relu", mlp_layers(32, 16 if small else width, 2, 1))
        n = 32 if small else 2000
        real = formula([n, 32], 1, s.next_t()).astype(dt)
        s.count_listed()
        fake = formula([n, 32], 1, s.next_t()).astype(dt)
        s.count_listed()
        e = (0.5 + 0.5 * formula([n, 1], 1, s.next_t())).astype(dt)
        s.count_listed()
        s.add_data(real)
        s.add_data(fake)
        s.add_data(e)
        # formed in the dtype, elementwise (numpy's float32 ops round each as ATen's do)
        s.add_data((e * real + (1 - e) * fake).astype(dt), True)
        s.sizes = "%d" % n
        return s
    if name == "hvp":
        s = Spec(name, dt, small, 2, "tanh", mlp_layers(64, 16 if small else 256, 2, 10))
        n = 16 if small else 512
        s.add_listed([n, 64])
        s.add_data(np.arange(n, dtype=np.int64) % 10)
        s.count_listed()
        for w in s.weights:
            s.add_data(formula(list(w.shape), 1, s.next_t()).astype(dt))
            s.count_listed()
        s.sizes = "%d" % n
        return s
    if name == "maml":
        s = Spec(name, dt, small, 2, "tanh", mlp_layers(1, 40, 2, 1))
        n = 32 if small else 1000
        for _ in range(2):
            x = formula([n, 1], 3, s.next_t())
            s.count_listed(2)  # x, then y = sin(x)
            s.add_data(x.astype(dt))
            s.add_data(np.sin(x).astype(dt))
        s.sizes = "%d + %d" % (n, n)
        return s
    raise ValueError("unknown workload '%s' (one of %s)" % (name, ", ".join(NAMES)))


def max_rel_diff(loss, grads, ref_loss, ref_grads):
    """max over the loss and every gradient of max |x - ref| / max |ref| (a zero reference
    divides by 1e-30), as test/support/higher_order.hpp's max_rel_diff."""
    d = abs(float(loss) - float(ref_loss)) / max(abs(float(ref_loss)), 1e-30)
    if len(grads) != len(ref_grads):
        return math.inf
    for a, b in zip(grads, ref_grads):
        a = np.asarray(a, dtype=np.float64)
        b = np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            return math.inf
        d = max(d, float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-30))
    return d


# ---------------------------------------------------------------------------- torch


def mlp(x, w, act, matmul):
    """The workloads' network: layers x @ W + b (w = [W1, b1, W2, b2, ...]), `act` between
    them, none after the last; `matmul` is the framework's matrix product."""
    h = x
    layers = len(w) // 2
    for i in range(layers):
        h = matmul(h, w[2 * i]) + w[2 * i + 1]
        if i + 1 < layers:
            h = act(h)
    return h


PDE_WORKLOADS = ("burgers", "burgers_residual", "kdv")


def pde_loss(name, u, u_t, u_x, u_xx, u_xxx, boundary_error, mean):
    """The loss of the PDE workload `name` (one of PDE_WORKLOADS) from u = net(X) and its
    derivatives; u_xx, u_xxx and boundary_error (net(X_b) - g_b) are called where needed.
    burgers: f = u_t + u u_x - nu u_xx; kdv: f = u_t + 6 u u_x + u_xxx; mean(f^2)
    [+ mean((u_b - g_b)^2), not for burgers_residual]."""
    boundary = name != "burgers_residual"
    kdv = name == "kdv"
    if kdv:
        u_xxx = u_xxx()
        f = u_t + 6.0 * u * u_x + u_xxx
    else:
        f = u_t + u * u_x - u_xx() * BURGERS_NU
    l = mean(f * f)
    if boundary:
        e = boundary_error()
        l = l + mean(e * e)
    return l


def torch_loss_fn(spec):
    """loss(w, d) -> scalar tensor, on torch autograd (inner grads with create_graph).
    For hvp the returned scalar is dot(grad(L, w), v), whose gradient in w is H v."""
    import torch
    import torch.nn.functional as F

    act = {"tanh": torch.tanh, "silu": F.silu, "softplus": F.softplus,
           "leaky_relu": lambda h: F.leaky_relu(h, 0.2)}[spec.act]

    def net(x, w):
        return mlp(x, w, act, torch.mm)

    def sum_grad(y, x):
        return torch.autograd.grad([y], [x], [torch.ones_like(y)], create_graph=True)[0]

    name = spec.name
    if name in PDE_WORKLOADS:
        def loss(w, d):
            x = d[0]
            u = net(x, w)
            du = sum_grad(u, x)
            u_t = du.narrow(1, 0, 1)
            u_x = du.narrow(1, 1, 1)
            u_xx = sum_grad(u_x, x).narrow(1, 1, 1)
            return pde_loss(name, u, u_t, u_x, lambda: u_xx,
                            lambda: sum_grad(u_xx, x).narrow(1, 1, 1),
                            lambda: net(d[1], w) - d[2], torch.mean)
        return loss
    if name in ("poisson", "poisson128"):
        def loss(w, d):
            x = d[0]
            u = net(x, w)
            du = sum_grad(u, x)
            u_xx = sum_grad(du.narrow(1, 0, 1), x).narrow(1, 0, 1)
            u_yy = sum_grad(du.narrow(1, 1, 1), x).narrow(1, 1, 1)
            r = u_xx + u_yy + d[1]
            e = net(d[2], w) - d[3]
            return (r * r).mean() + (e * e).mean()
        return loss
    if name in ("forces_silu", "forces_softplus"):
        def loss(w, d):
            e = net(d[0], w)
            f = -sum_grad(e, d[0])
            de = e - d[1]
            df = f - d[2]
            return (de * de).mean() + (df * df).mean()
        return loss
    if name in ("critic128", "critic512"):
        def loss(w, d):
            d_fake = net(d[1], w)
            d_real = net(d[0], w)
            d_hat = net(d[3], w)
            g = sum_grad(d_hat, d[3])
            gap = torch.sqrt((g * g).sum(1, keepdim=True)) - 1.0
            return d_fake.mean() - d_real.mean() + 10.0 * (gap * gap).mean()
        return loss
    if name == "hvp":
        def loss(w, d):
            l = F.cross_entropy(net(d[0], w), d[1])
            g = torch.autograd.grad([l], list(w), create_graph=True)
            dot = (g[0] * d[2]).sum()
            for i in range(1, len(g)):
                dot = dot + (g[i] * d[2 + i]).sum()
            return dot
        return loss
    if name == "maml":
        def loss(w, d):
            es = net(d[0], w) - d[1]
            g = torch.autograd.grad([(es * es).mean()], list(w), create_graph=True)
            p = [wi - 0.01 * gi for wi, gi in zip(w, g)]
            eq = net(d[2], p) - d[3]
            return (eq * eq).mean()
        return loss
    raise ValueError("unknown workload '%s'" % name)


def torch_inputs(spec):
    """The weights (leaves requiring grad) and data (those the loss differentiates in
    require grad) as torch tensors."""
    import torch
    w = [torch.from_numpy(a.copy()).requires_grad_(True) for a in spec.weights]
    d = [torch.from_numpy(a.copy()).requires_grad_(g) for a, g in zip(spec.data, spec.data_grad)]
    return w, d


def torch_step_fn(spec):
    """step(w, d) -> (loss, grads): the loss (for hvp: dot(grad L, v)) and its gradients in
    the weights (for hvp: H v)."""
    import torch
    loss_fn = torch_loss_fn(spec)

    def step(w, d):
        l = loss_fn(w, d)
        g = torch.autograd.grad([l], list(w))
        return l.detach(), list(g)
    return step


# ---------------------------------------------------------------------------- JAX

def jax_step_fn(spec):
    """A jitted step(w, d) -> (loss or None, grads): jit(value_and_grad(loss)); for hvp
    jit of jvp(grad(L)) (returns None for the loss, and H v)."""
    import jax
    import jax.numpy as jnp

    def act(h):
        if spec.act == "tanh":
            return jnp.tanh(h)
        if spec.act == "silu":
            return jax.nn.silu(h)
        if spec.act == "softplus":
            return jax.nn.softplus(h)
        return jax.nn.leaky_relu(h, 0.2)

    def net(x, w):
        return mlp(x, w, act, jnp.dot)

    def sum_grad(fn, x):
        """d(sum fn(x))/dx."""
        return jax.grad(lambda z: jnp.sum(fn(z)))(x)

    name = spec.name
    if name in PDE_WORKLOADS:
        def loss(w, d):
            x = d[0]
            u_fn = lambda z: net(z, w)
            du_fn = lambda z: sum_grad(u_fn, z)
            u_x_fn = lambda z: du_fn(z)[:, 1:2]
            u_xx_fn = lambda z: sum_grad(u_x_fn, z)[:, 1:2]
            u = u_fn(x)
            du = du_fn(x)
            u_t = du[:, 0:1]
            u_x = du[:, 1:2]
            return pde_loss(name, u, u_t, u_x, lambda: u_xx_fn(x),
                            lambda: sum_grad(u_xx_fn, x)[:, 1:2],
                            lambda: net(d[1], w) - d[2], jnp.mean)
        return jax.jit(jax.value_and_grad(loss))
    if name in ("poisson", "poisson128"):
        def loss(w, d):
            x = d[0]
            u_fn = lambda z: net(z, w)
            du_fn = lambda z: sum_grad(u_fn, z)
            u_xx = sum_grad(lambda z: du_fn(z)[:, 0:1], x)[:, 0:1]
            u_yy = sum_grad(lambda z: du_fn(z)[:, 1:2], x)[:, 1:2]
            r = u_xx + u_yy + d[1]
            e = net(d[2], w) - d[3]
            return jnp.mean(r * r) + jnp.mean(e * e)
        return jax.jit(jax.value_and_grad(loss))
    if name in ("forces_silu", "forces_softplus"):
        def loss(w, d):
            e = net(d[0], w)
            f = -sum_grad(lambda z: net(z, w), d[0])
            de = e - d[1]
            df = f - d[2]
            return jnp.mean(de * de) + jnp.mean(df * df)
        return jax.jit(jax.value_and_grad(loss))
    if name in ("critic128", "critic512"):
        def loss(w, d):
            d_fake = net(d[1], w)
            d_real = net(d[0], w)
            g = sum_grad(lambda z: net(z, w), d[3])
            gap = jnp.sqrt(jnp.sum(g * g, axis=1, keepdims=True)) - 1.0
            return jnp.mean(d_fake) - jnp.mean(d_real) + 10.0 * jnp.mean(gap * gap)
        return jax.jit(jax.value_and_grad(loss))
    if name == "hvp":
        def xent(w, d):
            logits = net(d[0], w)
            lse = jax.nn.logsumexp(logits, axis=1)
            picked = jnp.take_along_axis(logits, d[1][:, None], axis=1)[:, 0]
            return jnp.mean(lse - picked)

        def hvp(w, d):
            v = list(d[2:])
            _, hv = jax.jvp(lambda p: jax.grad(xent)(p, d), (list(w),), (v,))
            return None, hv
        return jax.jit(hvp)
    if name == "maml":
        def inner(w, d):
            es = net(d[0], w) - d[1]
            return jnp.mean(es * es)

        def loss(w, d):
            g = jax.grad(inner)(w, d)
            p = [wi - 0.01 * gi for wi, gi in zip(w, g)]
            eq = net(d[2], p) - d[3]
            return jnp.mean(eq * eq)
        return jax.jit(jax.value_and_grad(loss))
    raise ValueError("unknown workload '%s'" % name)


def jax_inputs(spec):
    import jax.numpy as jnp
    w = [jnp.asarray(a) for a in spec.weights]
    d = [jnp.asarray(a) for a in spec.data]
    return w, d
