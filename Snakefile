# aiayn: "Attention Is All You Need", reproduced as one DAG:
# download -> bpe -> binarize -> train -> average -> decode -> score -> report
#
#   snakemake --cores all                                     # the embedded demo
#   snakemake --cores all --configfile config/wmt14_en_de.yaml  # the paper
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/bpe.smk"
include: "workflow/rules/binarize.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/average.smk"
include: "workflow/rules/decode.smk"
include: "workflow/rules/score.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/export.smk"


rule all:
    input:
        rules.report.output,
    default_target: True


# The jobs' own messages (`error: ...`, `warning: ...`) are in their logs; these show them at the end.
onsuccess:
    show_job_messages(failed=False)


onerror:
    show_job_messages(failed=True)
