// Copies the wire contract (the repo's protos/conveyor/v1/*.proto) into dist/protos, where
// the SDK loads it at run time with @grpc/proto-loader. Run by `npm run build`, so a
// rebuild picks up fields added to the protos. CONVEYOR_PROTO_DIR overrides the source.
import { cpSync, existsSync, mkdirSync, readdirSync, rmSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const source = resolve(process.env.CONVEYOR_PROTO_DIR ?? join(here, "..", "..", "..", "protos"));
const from = join(source, "conveyor", "v1");
const to = join(here, "..", "dist", "protos", "conveyor", "v1");

if (!existsSync(from)) {
  console.error(`copy-protos: no protos at ${from} (set CONVEYOR_PROTO_DIR to the protos root)`);
  process.exit(1);
}
rmSync(join(here, "..", "dist", "protos"), { recursive: true, force: true });
mkdirSync(to, { recursive: true });
const files = readdirSync(from).filter((name) => name.endsWith(".proto"));
for (const name of files) {
  cpSync(join(from, name), join(to, name));
}
console.log(`copy-protos: ${files.length} files from ${from}`);
