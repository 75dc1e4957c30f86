"""swapaware's tests.

Some tests fork a child that drops to another uid and does plain socket or libmunge work
(tests/adapter/as_user.py) while the test process serves gRPC. gRPC's fork handlers then run in
that child and may deadlock there (grpc/grpc#22624: "Deadlock in grpc_postfork_child"); a
fresh-clone run saw such a child never answer. The child never uses gRPC, so the handlers are off
for the test processes, before gRPC is first imported (it reads this once, at import)."""
import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
