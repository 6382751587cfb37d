// The e2b JS SDK (npm) against a Strata node: create with envs, write a
// script, run it, stream a background process, kill it, read and list files.
// Prints one JSON line of what it saw; tests/test_envd.py checks it.
// E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY come from the environment.
import { Sandbox } from 'e2b'

const seen = {}
const sbx = await Sandbox.create('base', { timeoutMs: 300_000, envs: { ROLE: 'js-agent' } })
try {
  await sbx.files.write('/root/js/job.sh', 'echo hello from $ROLE; echo oops >&2; exit 4\n')
  seen.listed = (await sbx.files.list('/root/js')).map((e) => e.name)
  try {
    await sbx.commands.run('sh /root/js/job.sh')
  } catch (err) {
    seen.exitCode = err.exitCode
    seen.stdout = err.stdout
    seen.stderr = err.stderr
  }
  let streamed = ''
  const bg = await sbx.commands.run('for i in 1 2 3; do echo tick$i; sleep 0.2; done; sleep 600', {
    background: true,
    onStdout: (data) => { streamed += data },
  })
  for (let i = 0; i < 100 && !streamed.includes('tick3'); i++) await new Promise((r) => setTimeout(r, 100))
  seen.streamed = streamed
  seen.killed = await sbx.commands.kill(bg.pid)
  seen.read = await sbx.files.read('/root/js/job.sh')
  seen.exists = await sbx.files.exists('/root/js/nope')
} finally {
  await sbx.kill()
}
console.log(JSON.stringify(seen))
