# Sourced by cpu_recipe_levers.sh and gpu_drafter_quality.sh: the stage-04 flags of a recipe lane, named by its
# changes joined with "_" (lr10_steps4: ten times LR and four times the optimizer steps). One place for what a
# lane's name means, on either machine. Reads EPOCHS, LR, STEP_TOKENS; PY (the Python) and MODEL for mlp.
#   default, specforge, steps   no flag (specforge: its own trainer; steps: gpu_drafter_quality.sh's token count)
#   lrX       X times LR
#   stepsX    STEP_TOKENS / X tokens a step (X times the optimizer steps)
#   bsN       at most N sequences a step (bs1: one, as SpecForge's recipe steps)
#   epochs    twice EPOCHS; epochsX: X times
#   tttN      --ttt-steps N
#   lk, init, fixed, mlp   --loss lk, --init-from-verifier-layer, --ttt-positions fixed, twice the MLP width
recipe_flags() {  # $1 lane name: its flags on stdout; fails for a part it does not know
  local part number flags=""
  for part in ${1//_/ }; do
    number=${part##*[a-z]}
    case $part in
      default|specforge|steps) ;;
      lk) flags+=" --loss lk" ;;
      init) flags+=" --init-from-verifier-layer" ;;
      fixed) flags+=" --ttt-positions fixed" ;;
      mlp) flags+=" --drafter-config {\"intermediate_size\":$((2 * $(
        "$PY" -c "import json; print(json.load(open('$MODEL/config.json'))['intermediate_size'])")))}" ;;
      lr[0-9]*) [[ $number =~ ^[0-9]+(\.[0-9]+)?$ ]] && flags+=" --lr $("$PY" -c "print($number * $LR)")" ;;
      steps[0-9]*) [[ $number =~ ^[0-9]+$ ]] && flags+=" --max-tokens-per-batch $((STEP_TOKENS / number))" ;;
      bs[0-9]*) [[ $number =~ ^[0-9]+$ ]] && flags+=" --batch-size $number" ;;
      epochs) flags+=" --epochs $((2 * EPOCHS))" ;;
      epochs[0-9]*) [[ $number =~ ^[0-9]+$ ]] && flags+=" --epochs $((EPOCHS * number))" ;;
      ttt[0-9]*) [[ $number =~ ^[0-9]+$ ]] && flags+=" --ttt-steps $number" ;;
      *) false ;;
    esac || return 1
  done
  echo "$flags"
}
