-- written by commctx schema 2 (this repository before member secrets)
PRAGMA user_version = 2;
BEGIN TRANSACTION;
CREATE TABLE jobs (
        job_id TEXT PRIMARY KEY, state TEXT NOT NULL, generation INTEGER NOT NULL,
        reason TEXT NOT NULL, spec TEXT NOT NULL, world TEXT);
INSERT INTO "jobs" VALUES('pair','formed',1,'','{"world_size":2}','{"nodes":[{"node_key":"n0","address":"10.0.1.1","members":["00000000000000a1"]},{"node_key":"n1","address":"10.0.1.2","members":["00000000000000a2"]}],"roles":[],"master_addr":"10.0.1.1","master_port":29500}');
INSERT INTO "jobs" VALUES('waiting','forming',0,'','{"world_size":2}',NULL);
CREATE TABLE members (
        job_id TEXT NOT NULL, member_id TEXT NOT NULL, seq INTEGER NOT NULL,
        node_key TEXT NOT NULL, address TEXT NOT NULL, port INTEGER NOT NULL,
        local_rank INTEGER, node_rank INTEGER, role TEXT NOT NULL,
        PRIMARY KEY (job_id, member_id));
INSERT INTO "members" VALUES('pair','00000000000000a2',2,'n1','10.0.1.2',29501,NULL,NULL,'');
INSERT INTO "members" VALUES('pair','00000000000000a1',1,'n0','10.0.1.1',0,NULL,NULL,'');
INSERT INTO "members" VALUES('waiting','00000000000000a3',3,'n9','10.0.1.9',29600,NULL,NULL,'');
CREATE TABLE writer (id INTEGER PRIMARY KEY CHECK (id = 1), epoch INTEGER NOT NULL);
INSERT INTO "writer" VALUES(1,1);
COMMIT;
