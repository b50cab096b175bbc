#!/usr/bin/env bash
# Issue 36's small-scale record, the decisive runs first, one stage after another into runs/reproduce and recorded
# into $RECORD (each `reproduce --record` with --setups/--values keeps the record's other cells). RECORD defaults to
# runs/record: the committed record (results/reproduce) is written only when named, and then the generated blocks
# of README.md and docs/ are regenerated from it:
#
#   RECORD=results/reproduce scripts/decisive_small.sh
# The demo setting is run again with fresh seeds (3-5): its seeds 0-2 were recorded and judged before verdict rule
# version 2 and plateau rule revision 2 were written (partly from those runs), so the rules are tested on runs they
# have not seen; the stage replaces the record's demo rows of the cells it reruns.
# tab1 (and tab3, from its models) runs 6 seeds on both settings, the others 3: with 3 seeds every tab1 verdict was
# "not decidable here", each interval holding both 0 and half the paper's effect; the number 6 was fixed from those
# intervals' widths before the added runs (docs/reproduce.md, "What makes a run decisive"), and is not raised after.
# A run whose training is tab1's (the same resolved config) is tab1's run, linked (reproduce/experiments.py
# shares_training). Resumable: a killed stage goes on where it stopped (finished steps are skipped, a training run resumes from its
# last checkpoint), so the script can be killed and started again at any point.
#
#   scripts/decisive_small.sh                 # every stage, in order
#   scripts/decisive_small.sh fig1-hard       # one stage (names below)
#
# Wall time on the idle 2-core development machine (runs/*.log of issue 36's sweeps): a `hard` run is 8-12 minutes
# (90 epochs, masking 120, at about 1,650 img/s (5 s an epoch), then its evaluation), a `demo` run 3-5 (30 epochs,
# masking 40). At 60 epochs tab1-hard took 70 minutes.
#   tab1-hard        6 seeds (0-5): 18 runs     about 200 min
#   tab3-hard        tab1's models, evaluation  about 10 min
#   tab1-demo        6 fresh seeds (3-8): 18 runs   about 70 min
#   tab3-demo        tab1's models, evaluation  about 6 min
#   fig1-demo        |R| 50 and whole, seeds 3-5: 12 runs (standard is tab1's)   about 50 min
#   shortcut-demo    fig1's models, evaluation  about 5 min
#   fig1-hard        |R| 50 and whole: 12 runs (standard is tab1's)   about 130 min
#   shortcut-hard    fig1's models, evaluation  about 10 min
#   tab4-hard        alpha 0.5, 1 and 1 with the label target: 9 runs (alpha 0 and 0.25 are tab1's anchored and
#                    masking runs)   about 100 min
#   tab4-demo        the same on demo, seeds 3-5 (the earlier 12-epoch cells replaced): 9 runs   about 45 min
#   er               the testbed, then the fine-tunes with the dense early checkpoints   about 60 min
#   fig5a-demo, fig5b-demo   fig5a / fig5b at three values each on demo, seeds 3-5: 18 runs each (geometric and
#                    0% noise are tab1's)   about an hour each (the memory loader applies TrivialAugment per image)
# The longer stages go a seed at a time (STAGE-sK: seed K alone; STAGE: every seed in turn), each seed recorded as it
# ends, so that no piece outlasts a session's two hours or so of runs on the development machine, whose runs/ may not
# outlive the session: a record gathers a cell's seeds of one configuration over several sweeps (the `settings` digest
# of each row, reproduce/sweep.py keep_other_cells). A seed's piece trains what it evaluates again where runs/ lacks it.
#   tab1-r18-sK      tab1 on demo_resnet18 (the CIFAR ResNet-18 in bf16: about 160 img/s on a CPU with AMX, 16 min a
#                    30-epoch run; about 110 img/s, 25 min, on an Intel one with AVX-512 bf16 alone; about 190 img/s,
#                    15 min, on an AMD EPYC with AVX-512 bf16), then tab3 from its models: 3 runs   about 50 min a
#                    seed with AMX, 115 without
#   fig1-r18-sK      fig1-r18-sK-50, then fig1-r18-sK-whole; each |R| on demo_resnet18 (standard is tab1's, trained
#                    again where runs/ lacks it), then the shortcut probe on its models, recorded as it ends:
#                    -50 3 runs, about 60 min on the AMD EPYC with AVX-512 bf16; -whole 2 runs, about 40 min
#                    (55 where runs/ lacks standard). On an AMD EPYC with AVX2 alone (no AVX-512) bf16
#                    runs under 10 img/s (not 20 steps of 128 in 250 s): not on such a machine
#   fig1-demo-rest   |R| 5, 10 and 500 on demo, seeds 3-5 (the earlier 12-epoch cells replaced): 18 runs, then the
#                    shortcut probe   about 70 min
#   fig5a-hard-sK, fig5b-hard-sK   at three values each on hard (geometric and 0% noise are tab1's): 9 runs
#                    about 90 min a seed; fig5a's TrivialAugment trains 150 epochs there (masking 200) and PixMix
#                    250 (masking 334: reproduce/scales.py HARD_POLICY_EPOCHS), about 4 h a seed. fig5b runs seeds
#                    0-3: its verdict counts seeds 1-3, those trained after plateau revision 3 (seed 0 was read before)
#   fig5a-hard-sK-POLICY   one policy of one seed (geometric, trivialaugment or pixmix): 3 runs, for a session
#                    whose runs/ does not outlive it, on a machine where a seed's three policies take longer than it
#                    (an AMD EPYC with AVX2 alone: about 720 img/s for standard with TrivialAugment; there -pixmix
#                    takes about 2.5 h, -trivialaugment 90 min, -geometric under an hour with runs/ empty)
set -euo pipefail
cd "$(dirname "$0")/.."
FASTANCHOR=${FASTANCHOR:-.venv/bin/fastanchor}
RECORD=${RECORD:-runs/record}
mkdir -p runs
run() {  # stage name, then the reproduce arguments
    local name=$1; shift
    echo "== $name: fastanchor reproduce $* --scale small --record $RECORD (log: runs/decisive-$name.log)"
    "$FASTANCHOR" reproduce "$@" --scale small --no-progress --record "$RECORD" > "runs/decisive-$name.log" 2>&1
}

stage=${1:-all}
stages=" all tab1-hard tab3-hard tab1-demo tab3-demo fig1-demo shortcut-demo fig1-hard shortcut-hard tab4-hard tab4-demo er "
stages+="fig5a-demo fig5b-demo fig1-demo-rest "
seeded=" tab1-r18 fig1-r18 fig5a-hard fig5b-hard "  # also STAGE-s0, -s1, -s2 (fig5b-hard: and -s3)
[[ "$stages$seeded" == *" $stage "* || ($seeded == *" ${stage%-s[012]} "* && $stage == *-s[012]) || $stage == fig5b-hard-s3 || $stage =~ ^fig5a-hard-s[012]-(geometric|trivialaugment|pixmix)$ || $stage =~ ^fig1-r18-s[012]-(50|whole)$ ]] ||
    { echo "scripts/decisive_small.sh: no stage '$stage' (expected one of:$stages${seeded# }or one of the last four with -s0, -s1 or -s2; fig5b-hard-s3; fig5a-hard-sK-geometric, -trivialaugment or -pixmix; fig1-r18-sK-50 or -whole)" >&2; exit 2; }
want() { [[ $stage == all || $stage == "$1" || $1 == "$stage"-s[0-9] || $1 == "$stage"-s[0-9]-* || ($stage == *-s[0-9] && $1 == "$stage"-*) ]]; }
want tab1-hard && run tab1-hard tab1 --setups hard --seeds 6
want tab3-hard && run tab3-hard tab3 --setups hard --seeds 6
want tab1-demo && run tab1-demo tab1 --setups demo --seeds 6 --first-seed 3
want tab3-demo && run tab3-demo tab3 --setups demo --seeds 6 --first-seed 3
want fig1-demo && run fig1-demo fig1 --setups demo --values 50,whole --first-seed 3
want shortcut-demo && run shortcut-demo shortcut --setups demo --values 50,whole --first-seed 3
want fig1-hard && run fig1-hard fig1 --setups hard --values 50,whole
want shortcut-hard && run shortcut-hard shortcut --setups hard --values 50,whole
want tab4-hard && run tab4-hard tab4 --setups hard
want tab4-demo && run tab4-demo tab4 --setups demo --first-seed 3
want er && run er-testbed er-testbed && run er-finetune er-finetune
want fig5a-demo && run fig5a-demo fig5a --setups demo --first-seed 3
want fig5b-demo && run fig5b-demo fig5b --setups demo --first-seed 3
for s in 0 1 2; do
    want tab1-r18-s$s && run tab1-r18-s$s tab1 --setups demo_resnet18 --first-seed $s --seeds 1 &&
        run tab3-r18-s$s tab3 --setups demo_resnet18 --first-seed $s --seeds 1
done
for s in 0 1 2; do
    for v in 50 whole; do  # a value at a time, each recorded as it ends: a whole seed outlasts some sessions
        want fig1-r18-s$s-$v && run fig1-r18-s$s-$v fig1 --setups demo_resnet18 --values $v --first-seed $s --seeds 1 &&
            run shortcut-r18-s$s-$v shortcut --setups demo_resnet18 --values $v --first-seed $s --seeds 1
    done
done
want fig1-demo-rest && run fig1-demo-rest fig1 --setups demo --values 5,10,500 --first-seed 3 &&
    run shortcut-demo-rest shortcut --setups demo --values 5,500 --first-seed 3
for s in 0 1 2; do  # a seed's policies also one at a time (fig5a-hard-sK-pixmix): a whole seed outlasts a session
    want fig5a-hard-s$s-geometric &&
        run fig5a-hard-s$s-geometric fig5a --setups hard --values geometric --first-seed $s --seeds 1
    want fig5a-hard-s$s-trivialaugment &&
        run fig5a-hard-s$s-trivialaugment fig5a --setups hard --values trivialaugment --first-seed $s --seeds 1
    want fig5a-hard-s$s-pixmix &&
        run fig5a-hard-s$s-pixmix fig5a --setups hard --values pixmix --first-seed $s --seeds 1
done
for s in 0 1 2 3; do  # fig5b's verdict on hard counts seeds 1-3 (plateau revision 3, reproduce/convergence.py)
    want fig5b-hard-s$s && run fig5b-hard-s$s fig5b --setups hard --first-seed $s --seeds 1
done
[[ $RECORD == results/reproduce ]] && "$FASTANCHOR" docs
exit 0
