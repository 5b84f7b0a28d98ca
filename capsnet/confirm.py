"""The confirmatory test of the stop (docs/confirm.md): its 48 runs in one
registered sequence, fp32, from the registration commit, in the lock file's
environment; the registered protocol `protocols.CONFIRM` on the runner of
every registered protocol (capsnet/registered.py).

  python -m capsnet.confirm --out=$HOME/confirm --publish=PATH/study/confirm   # the runs
  python -m capsnet.confirm --train=false --out=study/confirm    # the report
  python -m capsnet.confirm --power                 # the registered power computation
  python -m capsnet.confirm --order                 # the registered order table
  python -m capsnet.confirm --audit                 # the published runs against it
"""
from capsnet import registered
from capsnet.science import protocols

if __name__ == "__main__":
  registered.run(protocols.CONFIRM)
