"""script_test: a test rule in plain Starlark, so that the sample needs no rules from the
network (see README.md)."""

def _script_test_impl(ctx):
    script = ctx.actions.declare_file(ctx.label.name + ".sh")
    ctx.actions.write(
        output = script,
        content = "#!/bin/sh\n{}\nexit {}\n".format(ctx.attr.script, ctx.attr.exit_code),
        is_executable = True,
    )
    return [DefaultInfo(executable = script)]

script_test = rule(
    implementation = _script_test_impl,
    test = True,
    doc = "A test whose executable is a shell script: `script`, then `exit exit_code`.",
    attrs = {
        "script": attr.string(doc = "Shell commands run first (/bin/sh).", default = ""),
        "exit_code": attr.int(doc = "The test's exit status after `script`.", default = 0),
    },
)
