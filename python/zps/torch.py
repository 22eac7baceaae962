"""zps.torch — train a PyTorch model against zps servers with a few changed lines.

    model = torchvision.models.resnet18(num_classes=10)
    ps = zps.torch.ParameterServer(model, servers, trainer_id=rank, num_trainers=world,
                                   mode="sync", optimizer="momentum", lr=0.1, momentum=0.9)
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)   # forward first waits for the pulled values
        loss.backward()                        # each gradient is pushed as backward makes it
        ps.step()                              # instead of optimizer.step() / zero_grad()
    ps.close()                                 # LEAVE: the others stop waiting for us

What it does, and the invariants it keeps:
  - The model's parameters (those that require grad) are registered in state_dict order,
    under their state_dict names; buffers (batch-norm statistics) stay local to each trainer.
  - Every trainer offers its initial values; the first to INIT wins, and every trainer then
    pulls the servers' values, so all start from the same model.
  - A hook on each parameter pushes its gradient the moment autograd has it (a leaf's hook
    runs once per backward, with the gradient summed over every use), so the pushes of the
    last layers travel while backward still computes the first ones. The gradient tensor
    itself is what travels (no copy); it must not be changed (no in-place clipping) before
    step() returns.
  - step() pushes zeros for a parameter that got no gradient (the servers' sync step waits
    for every chunk), waits for the pushes, sets .grad to None and issues the pulls of every
    parameter into its own storage; a forward pre-hook on the model waits for them.
  - Steps follow zps.h "Steps": sync pushes the version it computed from and pulls
    version + 1 (the servers average the num_trainers gradients of a step); async pushes the
    version and pulls without waiting; ssp pushes and pulls the trainer's clock.
"""
import torch

import zps


class ParameterServer:
    def __init__(self, model, servers, trainer_id=0, num_trainers=1, mode="sync", staleness=0,
                 optimizer="sgd", lr=0.01, schedule="constant", chunk_bytes=0, push_dtype="f32",
                 client_options=None, **optimizer_fields):
        if mode not in ("sync", "async", "ssp"):
            raise ValueError("mode: sync, async or ssp, not %r" % (mode,))
        self.model, self.mode = model, mode
        named = dict(model.named_parameters())
        keys = [k for k in model.state_dict(keep_vars=True) if k in named]
        self.names = [k for k in keys if named[k].requires_grad]
        self.params = [named[k] for k in self.names]
        for name, p in zip(self.names, self.params):
            if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
                raise TypeError("zps.torch: parameter %s must be a contiguous float32 CPU "
                                "tensor" % name)
        self.client = zps.Client(servers, trainer_id, push_dtype=push_dtype,
                                 **(client_options or {}))
        self.job = self.client.register([(n, p.numel()) for n, p in zip(self.names, self.params)],
                                        mode=mode, num_trainers=num_trainers,
                                        staleness=staleness, chunk_bytes=chunk_bytes)
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.initialised = self.client.init(flat, optimizer=optimizer, lr=lr, schedule=schedule,
                                            **optimizer_fields)
        self.steps = 0        # steps this trainer completed (the ssp clock)
        self.version = 0      # the model version the next forward computes with
        self._pushes = {}     # parameter index -> (ticket, gradient kept alive)
        self._pulls = [self.client.pull(i, p.data, -1) for i, p in enumerate(self.params)]
        self._wait_pulls()
        self._hooks = [p.register_hook(self._hook(i)) for i, p in enumerate(self.params)]
        self._hooks.append(model.register_forward_pre_hook(lambda m, x: self._wait_pulls()))

    def _push_step(self):
        return self.steps if self.mode == "ssp" else self.version

    def _hook(self, i):
        def push_grad(grad):
            if i in self._pushes:
                raise RuntimeError("zps.torch: a second backward before step() pushed %s twice"
                                   % self.names[i])
            g = grad.detach()
            if g.dtype != torch.float32 or not g.is_contiguous():
                g = g.to(torch.float32).contiguous()  # the one case that copies
            self._pushes[i] = (self.client.push(i, g, self._push_step()), g)
        return push_grad

    def _wait_pulls(self):
        if self._pulls:
            pulls, self._pulls = self._pulls, []
            self.version = min(self.client.wait(t) for t in pulls)

    def step(self):
        """Ends a step: the pushes complete, then the pulls of the next values are issued."""
        for i, p in enumerate(self.params):
            if i not in self._pushes:
                z = torch.zeros_like(p)
                self._pushes[i] = (self.client.push(i, z, self._push_step()), z)
        pushes, self._pushes = self._pushes, {}
        try:
            for t, _ in pushes.values():
                self.client.wait(t)
        finally:
            for p in self.params:
                p.grad = None
        self.steps += 1
        pull_step = (self.version + 1 if self.mode == "sync"
                     else self.steps if self.mode == "ssp" else -1)
        self._pulls = [self.client.pull(i, p.data, pull_step)
                       for i, p in enumerate(self.params)]

    def close(self):
        """Waits for the last pulls, LEAVEs the job and disconnects."""
        if self.client is None:
            return
        try:
            self._wait_pulls()
            self.client.leave()
        finally:
            for h in self._hooks:
                h.remove()
            self.client.close()
            self.client = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
