"""Failure detection and recovery (xDeepServe §6). The runbook; each step names its function.

A decode die dies (colocated die, afd attention or expert die; `dead` or `stuck` rows):
  Step 1 (§6.1): the TE-shell pings every DP master (and every afd expert die) each
      health.dp_interval_s; a die answers from its event loop only, between iterations
      (`detector.Detector.poll` -> `watch.HeartbeatSender.tick`; the die's side
      `ranks/core/decode_die.DecodeDieLoop.step` -> `watch.DieHealth.answer`). A dead die
      answers nothing (`watch.DieHealth.fall_silent`, played by ranks/faults/dead.py); a stuck
      one blocks inside its first dispatch / A2E (ranks/faults/stuck.py), and its peers wait for
      it in their XCCL waits
      or in the agreement between iterations.
  Step 2 (§6.1): a die silent for health.timeout_s (or 3x the dies' slowest gap between two
      answers, when longer: `watch.HeartbeatSender.patience_s`) is suspected; the TE-shell
      fences: one word into every die's abort-word window (`detector.Detector.fence` ->
      `xccl.recovery.rollback.fence`). Every wait checks it and raises Released; the die turns
      out of the iterations (`DieHealth.released`, `DecodeDieLoop.out_turn`) and answers again.
      With faults.on_timeout recompute a wait may time out first: the die votes
      (`recompute.Recomputer.vote`), and the lost die's missing vote outlasts detection, so the
      fence ends the vote too.
  Step 3 (§6.1): a die still silent after the grace is lost ("dead"; answering later: "stuck");
      with none lost, the stuck die came back and every die rebuilds anyway
      (`detector.Detector.fence` -> `Loss`). If an expert would lose its last replica the run
      stops naming die and experts (`detector.Detector._why_not_scale` -> DecodeDieLost).
  Step 4 (§6.2 stage 2): the TE-shell tells every survivor which dies are lost, with EPLB its
      newest placement without their slots (`scale_down.scale_down` -> `scale_down.rebuild`).
  Step 5 (§6.2 stage 2): each survivor takes the word in its loop (`DecodeDieLoop.out_turn`
      -> `watch.DieHealth.take_failover`) and rebuilds itself (`ColocatedDie.rebuild`,
      `AfdDieBase.rebuild`): the interrupted iteration undone
      (`recompute.Recomputer.restore_interrupted`), a communicator of the survivors
      (`scale_down.survivors`), its XCCL buffer rebuilt on it (`EpBuffer.rebuilt`,
      `AfdBuffer.rebuilt`), the vote moved with it (`recompute.Recomputer.regroup`), the lost
      slots out of the placement (`scale_down.without_dies`, `scale_down.rerouted`), and says
      how many token batches it sent (`scale_down.send_ready`).
  Step 6 (§6.2 stage 2): the TE-shell takes those batches (`Frontend.take_batches`), gives up
      the lost groups' requests (`Frontend.drop_groups` -> orphans) and prefills them again
      with the tokens they emitted (`scale_down.resumed`, `Frontend.readmit`).
  Step 7: one failure record per row (`detector.Detector.records` -> `records.failure_records`,
      `records.with_timeouts`), in the run file.
  A lost die idles until the TE-shell's stop and leaves without a collective
  (`DecodeDieLoop.leave`).

A transient XCCL error or a timed-out wait (§6.2 stage 3, faults.table / faults.rate /
faults.on_timeout recompute): every die votes once per attempt and all re-execute a failed
iteration (the die's own loop calls `recompute.Recomputer.fail` / `vote` ->
xccl/recovery/rollback.py `Recovery.failed` / `settle`). Beside a lost die the same goes on over
the survivors (Step 5's `recompute.Recomputer.regroup`: the vote, and the executions of the
iteration the fence cut, so that its faults do not fire again).

A memory fault (§6.2 stage 3, `memory` rows): KV blocks masked and their requests ended
(`memory.MemoryCheck.check` -> the request ids; the TE-shell's `Frontend.end_requests`),
or an expert slot masked while a replica serves (`memory.SlotMask.check`; afd: `memory.AfdSlots`).

PD (§6.2 "P/D separate failover"): a decode die's loss is found by the decode TE-shell
(`decode_loss.DecodeWatch`) and its requests moved by the JE (`je_decode_loss`); a lost prefill
die (`je_prefill_loss`); a KV link or a saturated die (`link_probe`, `pd_send_failover`,
`pd_receive_failover`). The faults themselves are emulated on their dies, in ranks/faults/
(dead, stuck, KV-transfer errors) and ranks/pd/ (`prefill_loss.py`, `channel.py`), which
recovery never imports.
"""
