"""zps.torch's hooks: parameters registered in state_dict order under their names; each
gradient pushed from its hook while backward runs (last layer first, none left for step()),
the pushed tensor being the gradient autograd made (no copy); zeros for a parameter that got
no gradient; the next forward waits for the pulls; one step equals torch's SGD step."""
import numpy as np
import torch

import zps.torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 5)
        self.bn = torch.nn.BatchNorm1d(5)  # buffers: not registered
        self.b = torch.nn.Linear(5, 2)
        self.unused = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))


def test_hooks_push_during_backward_and_step_matches_sgd(servers):
    uri, = servers(1)
    torch.manual_seed(0)
    net = Net()
    ref = Net()
    ref.load_state_dict(net.state_dict())
    ps = zps.torch.ParameterServer(net, [uri], mode="sync", optimizer="sgd", lr=0.1)
    assert ps.names == list(k for k in net.state_dict() if "running" not in k and
                            "num_batches" not in k)
    assert ps.names == ["unused", "a.weight", "a.bias", "bn.weight", "bn.bias", "b.weight",
                        "b.bias"]
    assert ps.client.names == ps.names
    pushed = []
    push = ps.client.push

    def spy(var, grads, step):
        pushed.append((ps.names[var], grads.data_ptr()))
        return push(var, grads, step)
    ps.client.push = spy
    seen = {}  # what autograd hands the hooks (this one runs after zps.torch's)
    for n, p in zip(ps.names, ps.params):
        p.register_hook(lambda g, n=n: seen.__setitem__(n, g.data_ptr()))
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    loss = torch.nn.functional.cross_entropy(net(x), y)
    loss.backward()
    names = [n for n, _ in pushed]
    assert names[:2] == ["b.bias", "b.weight"] or names[:2] == ["b.weight", "b.bias"], names
    assert set(names) == set(ps.names) - {"unused"}, "pushed before step(): %s" % names
    assert all(seen[n] == ptr for n, ptr in pushed), "a pushed gradient was a copy"
    ps.step()
    assert [n for n, _ in pushed][-1] == "unused"  # zeros, from step()
    assert all(p.grad is None for p in ps.params)
    assert ps._pulls, "step() issues the pulls"
    net(x)  # the forward pre-hook waits for them
    assert not ps._pulls and ps.version == 1
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    opt.step()
    for (n, p), q in zip(net.named_parameters(), ref.parameters()):
        assert np.allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-6), n
    ps.close()
