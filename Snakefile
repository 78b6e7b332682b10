# aiayn: "Attention Is All You Need", reproduced as one DAG:
# download -> bpe -> binarize -> train -> average -> decode -> score -> report
#
#   snakemake --cores all                                     # the demo (config/config.yaml)
#   snakemake --cores all --configfile config/wmt14_en_de.yaml  # the paper
from snakemake.utils import min_version

min_version("9.0")


# The demo is one config among the others, used when no --configfile is given: under a user's config
# lies only the schema with its defaults (common.smk), never the demo's values. Its path is this
# file's folder, not the working directory, so `snakemake -s <clone>/Snakefile` runs from anywhere;
# as a module (docs/elsewhere.md) the user's config is used instead.
DEMO_CONFIG = f"{workflow.current_basedir}/config/config.yaml"


if not workflow.overwrite_configfiles:

    configfile: DEMO_CONFIG



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


# A workflow whose presets ask for GPUs: its disk, time and traps, before any job is queued.
onstart:
    preflight()


# The jobs' own messages (`error: ...`, `warning: ...`) are in their logs; these show them at the end,
# then which model each run reports (the average stage's choice) and where the report is.
onsuccess:
    show_job_messages(failed=False)
    show_reported_models()
    show_report_folder()


onerror:
    show_job_messages(failed=True)
